"""Whole-system chaos soak: the full stack as real processes, faults injected while it trains, and an accounting of
every sample at the end. The harness of tests/chaos/test_soak.py (a short run in the chaos loop of CONTRIBUTING.md),
and a long run from the command line:

    python -m tests.chaos.soak                      # >= 2,000 trained episodes (samples), from the repository root
    python -m tests.chaos.soak --episodes 400       # smaller
    python -m tests.chaos.soak --appendfsync everysec
    python -m tests.chaos.soak --cluster            # on a six-node Redis Cluster, the run's queue in 3 partitions

The stack: `redis-server` with AOF (`--appendonly yes --appendfsync always`, or everysec), two synthetic reference
engines (`rollq engine --backend synthetic`), three `rollq worker` processes and the trainer (`rollq train`, the toy
task, max staleness eta = 2, `--trained-log`: every trained (job id, sample index) goes to RUN_DIR/trained.jsonl).
While it runs a driver injects, one at a time:

- worker_kill: SIGKILL a random worker every --worker-kill-every seconds and start a replacement (a new name);
- engine_kill: SIGKILL an engine and restart it on the same port;
- redis_kill: SIGKILL redis-server and restart it on the same port and directory (from its AOF); with --cluster
  (six `redis-server --cluster-enabled yes`, three primaries with a replica each, `--partitions` partitions) SIGKILL
  a primary (first the one holding the run's ledger, then the others in turn), wait for its replica to take over
  (`--cluster-node-timeout`), and restart it: it rejoins as a replica;
- trainer_kill: SIGKILL the trainer and restart it (it resumes from its checkpoint: checked in its log);
- worker_stall: SIGSTOP a worker that holds jobs until its jobs are reclaimed by the others (past its lease), then
  SIGCONT it (it finishes them too: the duplicates its publishes make must be dropped by the consumers).

The non-periodic faults are spread over 5%..60% of the run's training steps (--engine-kills, --redis-kills,
--trainer-kills, --stalls each); a fault takes seconds and the trainer keeps stepping meanwhile, so a short run may
finish before the last planned ones (the table says so; each kind must fire at least once).

The workload can be made harder for the accounting:

- --length-dist SPEC (the engines' output lengths, e.g. pareto:16:1.2), --max-new-tokens N (the cap, default 8) and
  --token-latency S (seconds per decode step): with a long tail, answers span several weight versions, and with
  --stale-policy mask the tokens older than v - eta leave the loss (`masked_tokens`);
- --fail-rate P: a fraction P of the samples fails in its reward on every attempt (tests/chaos/failing_reward.py,
  chosen by a hash of (job id, sample index)), so it is dead-lettered after the workers' max_attempts as an `error`
  trajectory;
- --partial-groups N (the trainer's): a group with failed samples trains on its survivors when at least N are left
  (its failed samples go back to the ledger as `failed`); otherwise it is dropped whole as `failed`.

The auditor keeps the token versions of every trajectory published, so the trained tokens are checked against what
the workers generated: per trained sample (from RUN_DIR/trained.jsonl) the tokens older than v - eta must be exactly
the ones the trainer masked (none under `drop`), none newer than v, and the trained, masked and generated totals of
metrics.jsonl must match.

At the end it prints an accounting table: samples admitted by the staleness ledger, trained (each exactly once),
dropped by reason (the trainer's: stale, failed = error trajectories, future, invalid; dead letters, the workers'
reply_gone count), left in flight when the run finished, duplicate trajectories on the results stream (dropped by the
consumers' dedup, counted by an audit consumer group; those the trainer held uncommitted are dropped by its collector),
faults per kind, the largest staleness trained against the bound, and the peak RSS per process kind in the first and
last quarter of the run from its first training step (sampled from /proc every second; the check is last <= 1.1 x
first). It fails (exit 1) when a sample was trained twice, an admitted group is neither trained, dropped nor in
flight, the staleness bound was exceeded, a fault kind never fired, or the run did not finish; with failures, when a
failing sample was trained, a trained group lacks samples other than its failed ones as the ledger recorded them, or
(with --partial-groups) no group trained partially; with a long tail and `mask`, when no token was masked. The last
line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from redis.exceptions import RedisError

from bench.common import REPO, BenchError, bench_env, print_summary, rollq_argv, run_bench
from rollq.config import with_query
from rollq.local import Processes, RedisServer, free_port, wait_until
from rollq.producer.results import PartitionedConsumer, ResultConsumer
from rollq.producer.status import gather_status
from rollq.protocol.keys import RunKeys
from rollq.redis_client import redis_client
from rollq.trainer.ledger import rest_field

FAULT_KINDS = ("worker_kill", "engine_kill", "redis_kill", "trainer_kill", "worker_stall")
PROCESS_KINDS = ("worker", "trainer", "ingress", "engine", "redis")
INGRESS_TOKEN = "chaos-token"
# What the soak's external client submits through the ingress meanwhile: short fixed trajectories (no engine).
INGRESS_JOB = {"workflow": "bench.workflows:FixedTrajectory", "workflow_kwargs": {"length": 64}, "n": 2}
# Synthetic engines: sampled tokens from the tiny tokenizer, 8 requests at once each (the decode step's latency and
# the length distribution come from the config).
ENGINE_ARGS = ("--tokenizer", "tiny", "--sampled", "--max-running", "8")
# The trainer's default workload (the toy task); --fail-rate swaps in the failing reward, on prompts of its own.
TOY_REWARD = "rollq.tasks.digits:digits_reward"
FAILING_REWARD = "tests.chaos.failing_reward:failing_digits_reward"
AUDIT_GROUP = "chaos-audit"


@dataclass
class ChaosConfig:
    episodes: int = 2000  # trained samples the run needs (steps = ceil(episodes / B))
    group_size: int = 4
    groups_per_step: int = 4
    max_staleness: int = 2
    workers: int = 3
    engines: int = 2
    concurrency: int = 16
    worker_kill_every_s: float = 5.0
    engine_kills: int = 2
    redis_kills: int = 2
    trainer_kills: int = 2
    stalls: int = 2
    lease_ms: int = 3000
    stall_extra_s: float = 0.0  # a stalled worker stays stopped this long after its jobs were reclaimed
    redis_down_s: float = 0.5  # the outage itself (how long Redis stays away), not a synchronisation
    appendfsync: str = "always"
    redis_outage_s: float = 60.0  # what every process rides out
    timeout_s: float = 1800.0  # the whole run
    seed: int = 0
    rss_every_s: float = 1.0
    cluster: bool = False  # a six-node Redis Cluster instead of one redis-server
    partitions: int = 3  # the run's partitions on the cluster
    cluster_node_timeout_ms: int = 1000  # how fast a killed primary's replica takes over
    ingress_every_s: float = 0.25  # an external client submits a job through the HTTP ingress this often (0: none)
    stale_policy: str = "drop"  # the trainer's: drop stale groups whole, or mask their tokens past the bound
    length_dist: str = "fixed"  # the synthetic engines' output lengths (fixed: max_new_tokens each)
    max_new_tokens: int = 8  # the workflow's cap on an answer (the trainer's default)
    token_latency_s: float = 0.002  # the engines' decode step
    fail_rate: float = 0.0  # samples whose reward raises on every attempt (dead-lettered as `error` trajectories)
    partial_groups: int = 0  # the trainer's: a group with failed samples trains on >= this many survivors (0: off)
    split_groups: int = 0  # the trainer's: a group's finished samples train ahead of its stragglers (0: off)
    join_late: bool = False  # the trainer's: what finishes during a step and would pass the bound joins it

    @property
    def batch(self) -> int:
        return self.group_size * self.groups_per_step

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.episodes / self.batch))

    @property
    def long_tail(self) -> bool:
        return self.length_dist.split(":")[0] != "fixed"

    def validate(self) -> None:
        if not 0 <= self.fail_rate < 1:
            raise BenchError(f"--fail-rate must be in [0, 1), got {self.fail_rate}")
        if self.partial_groups and not 1 <= self.partial_groups < self.group_size:
            raise BenchError(
                f"--partial-groups {self.partial_groups} never applies to groups of {self.group_size} (a partial "
                f"group has at most {self.group_size - 1} survivors): use 1..{self.group_size - 1}, or a larger "
                "--group-size"
            )
        if self.split_groups and not 2 <= self.split_groups < self.group_size:
            raise BenchError(f"--split-groups must be in 2..{self.group_size - 1} for groups of {self.group_size}")


@dataclass
class Fault:
    kind: str
    at_s: float
    step: int
    detail: str
    recovered_s: float = 0.0


@dataclass
class Child:
    kind: str
    name: str
    argv: list[str]
    proc: subprocess.Popen
    port: int = 0


# -- the stack --------------------------------------------------------------------------------------------------


class Stack:
    """The processes of the soak, each restartable with its original command line."""

    def __init__(self, cfg: ChaosConfig, procs: Processes, tmp: Path) -> None:
        self.cfg = cfg
        self.procs = procs
        self.tmp = tmp
        self.run = f"chaos{os.getpid()}"
        self.run_dir = tmp / "run"
        self.redis = RedisServer(directory=tmp / "redis", aof=True, appendfsync=cfg.appendfsync, processes=procs)
        self.redis.dir.mkdir()
        self.url = self.redis.url
        self.env = bench_env()
        self.children: dict[str, Child] = {}
        self._workers_started = 0
        self.cluster: Any = None  # tests.redis_cluster.LocalCluster with --cluster

    def _start(self, kind: str, name: str, argv: list[str], port: int = 0) -> Child:
        child = Child(kind, name, argv, self.procs.start(name, argv, env=self.env), port)
        self.children[name] = child
        return child

    def live(self, kind: str) -> list[Child]:
        return [c for c in self.children.values() if c.kind == kind and c.proc.poll() is None]

    def tail(self, child: Child) -> str:
        return self.procs.tail(child.proc)

    # redis
    async def start_cluster(self) -> None:
        """Six cluster nodes (the tests' harness), AOF always, each a `redis` child for the RSS sampler."""
        from tests.redis_cluster import LocalCluster

        cluster = LocalCluster(
            node_timeout_ms=self.cfg.cluster_node_timeout_ms, aof=True, directory=str(self.tmp / "cluster")
        )
        self.cluster = cluster
        await asyncio.to_thread(cluster.start)
        self.url = with_query(cluster.url, {"cluster": "yes"})
        self.sync_nodes()

    def sync_nodes(self) -> None:
        """The cluster nodes' current processes as children (a restarted node has a new one)."""
        for i, node in enumerate(self.cluster.nodes):
            if node.proc is not None:
                self.children[f"redis-node{i}"] = Child("redis", f"redis-node{i}", [], node.proc, node.port)

    async def start_redis(self) -> Child:
        """redis-server with AOF, on its first port and directory every time (a restart recovers from the AOF)."""
        await asyncio.to_thread(self.redis.start, 30)
        assert self.redis.proc is not None
        child = Child("redis", "redis", [], self.redis.proc, self.redis.port)
        self.children["redis"] = child
        return child

    # engines
    async def start_engine(self, index: int, port: int | None = None) -> Child:
        port = port or free_port()
        argv = [*rollq_argv(), "engine", "--backend", "synthetic", "--port", str(port), "--seed", str(index)]
        argv.append("--insecure-no-auth")  # keyless on loopback, its control routes open to the soak's trainer
        argv += [*ENGINE_ARGS, "--token-latency", str(self.cfg.token_latency_s), "--weights-root", str(self.run_dir)]
        if self.cfg.length_dist != "fixed":
            argv += ["--length-dist", self.cfg.length_dist]
        child = self._start("engine", f"engine{index}", argv, port)
        await self.engine_ready(child)
        return child

    async def engine_ready(self, child: Child) -> None:
        await self.http_ready(child, "/health")

    async def http_ready(self, child: Child, path: str) -> None:
        """Until `child` answers 200 on `path` (ChildExited if it exits, WaitTimeout past 60 s)."""
        import httpx

        async def healthy() -> bool:
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(f"http://127.0.0.1:{child.port}{path}", timeout=1)).status_code == 200
            except httpx.HTTPError:
                return False

        await self.procs.wait_until(healthy, 60, f"{child.name} {path}", watch=child.proc, interval_s=0.1)

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{c.port}" for c in self.children.values() if c.kind == "engine"]

    # ingress
    async def start_ingress(self) -> Child:
        port = free_port()
        argv = [*rollq_argv(), "ingress", "--redis", self.url, "--run", self.run, "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--tokens", f'{{"{INGRESS_TOKEN}": "chaos"}}', "--log-level", "WARNING"]
        child = self._start("ingress", "ingress", argv, port)
        await self.http_ready(child, "/healthz")
        return child

    # workers
    def start_worker(self) -> Child:
        name = f"worker{self._workers_started}"
        self._workers_started += 1
        argv = [*rollq_argv(), "worker", "--redis", self.url, "--run", self.run, "--name", name]
        argv += ["--concurrency", str(self.cfg.concurrency), "--lease-ms", str(self.cfg.lease_ms)]
        argv += [
            "--redis-outage-s",
            str(self.cfg.redis_outage_s),
            "--log-level",
            "WARNING",
            "--allow",
            "bench",
            "--allow",
            "tests.chaos.failing_reward",
            "--module-path",  # both from the repository: a worker never imports from its working directory
            str(REPO),
        ]
        for url in self.engine_urls:
            argv += ["--engine", url]
        return self._start("worker", name, argv)

    async def worker_registered(self, redis: Any, child: Child, timeout_s: float = 30) -> None:
        async def registered() -> bool:
            return bool(await redis.zscore(RunKeys(self.run).workers, child.name))

        what = f"{child.name} to register"
        await self.procs.wait_until(registered, timeout_s, what, watch=child.proc, interval_s=0.1)

    # trainer
    def trainer_argv(self) -> list[str]:
        c = self.cfg
        argv = [*rollq_argv(), "train", "--redis", self.url, "--run", self.run, "--run-dir", str(self.run_dir)]
        argv += [
            "--steps",
            str(c.steps),
            "--group-size",
            str(c.group_size),
            "--groups-per-step",
            str(c.groups_per_step),
        ]
        argv += ["--max-staleness", str(c.max_staleness), "--redis-outage-s", str(c.redis_outage_s), "--trained-log"]
        argv += ["--seed", str(c.seed), "--stale-policy", c.stale_policy]
        if c.partial_groups:
            argv += ["--partial-groups", str(c.partial_groups)]
        if c.split_groups:
            argv += ["--split-groups", str(c.split_groups)]
        if c.join_late:
            argv += ["--join-late"]
        if c.fail_rate or c.max_new_tokens != ChaosConfig.max_new_tokens:
            reward = FAILING_REWARD if c.fail_rate else TOY_REWARD
            kwargs = {"reward_fn": reward, "max_new_tokens": c.max_new_tokens}
            argv += ["--workflow-kwargs", msgspec.json.encode(kwargs).decode()]
        if c.fail_rate:  # the toy task's prompts, each carrying the rate to the reward (its data keyword)
            argv += ["--dataset", str(self.prompts_file())]
        if c.cluster:
            argv += ["--partitions", str(c.partitions)]
        for url in self.engine_urls:
            argv += ["--engine", url]
        return argv

    def prompts_file(self) -> Path:
        from rollq.tasks.digits import prompts

        path = self.tmp / "prompts.jsonl"
        if not path.exists():
            rows = [{**row, "fail_rate": self.cfg.fail_rate} for row in prompts()]
            path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in rows))
        return path

    def start_trainer(self, life: int) -> Child:
        return self._start("trainer", f"trainer{life}", self.trainer_argv())

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        try:
            return len(path.read_bytes().splitlines())
        except OSError:
            return 0

    def kill_all(self) -> None:
        """Teardown: SIGKILL every child (a SIGSTOPped one too) and reap it."""
        if self.cluster is not None:
            self.cluster.close()
        self.procs.stop_all(grace_s=0)

    def kill(self, child: Child) -> None:
        """SIGKILL: the crash being simulated."""
        self.procs.kill(child.proc)


# -- observers --------------------------------------------------------------------------------------------------


class Auditor:
    """Reads every trajectory published on the run's results stream through a consumer group of its own: counts the
    duplicates its dedup drops (the trainer's consumer drops the same ones) and the statuses, and keeps the
    generated tokens' versions of every sample (each distinct copy: a stalled worker's copy was generated again).
    Rides out Redis restarts (polls again once Redis answers)."""

    def __init__(self, url: str, run: str, partitions: int = 1) -> None:
        self.redis = redis_client(url)
        parts = [
            ResultConsumer(
                self.redis, RunKeys(run).at(p).results, group=AUDIT_GROUP, name="audit", release_inflight=False
            )
            for p in range(partitions)
        ]
        self.consumer = parts[0] if partitions == 1 else PartitionedConsumer(parts)
        self.statuses: Counter = Counter()
        self.samples: set[tuple[str, int]] = set()
        self.errors: set[tuple[str, int]] = set()  # samples published as `error` (dead-lettered)
        # (job id, sample index) -> its distinct copies, each the versions of its generated tokens as sorted
        # (version, count) pairs. Only what the consumer hands out: copies its dedup drops are not seen here.
        self.token_versions: dict[tuple[str, int], set[tuple[tuple[int, int], ...]]] = defaultdict(set)
        self.outages = 0
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.consumer.setup()  # before anything is published: it sees the whole run
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                batch = await self.consumer.read(count=512, block_ms=200)
                for d in batch:
                    t = d.trajectory
                    self.statuses[t.status] += 1
                    key = (t.job_id, t.sample_index)
                    self.samples.add(key)
                    if t.status == "error":
                        self.errors.add(key)
                    versions = Counter(
                        v for s in t.sequences for v, m in zip(s.versions, s.loss_mask, strict=True) if m
                    )
                    self.token_versions[key].add(tuple(sorted(versions.items())))
                await self.consumer.commit(batch)
            except (RedisError, OSError):
                self.outages += 1
                self.consumer.resync()
                await asyncio.sleep(0.2)  # Redis is away: poll again

    @property
    def duplicates(self) -> int:
        return self.consumer.duplicates_dropped

    async def drain(self, timeout_s: float = 10) -> None:
        """Until a read finds nothing new (bounded)."""
        deadline = time.monotonic() + timeout_s
        last = -1
        while time.monotonic() < deadline:
            now = sum(self.statuses.values()) + self.duplicates
            if now == last:
                return
            last = now
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.redis.aclose()


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class RssSampler:
    """Every `every_s`: the RSS of every live child, by kind, with the time since the start."""

    def __init__(self, stack: Stack, every_s: float) -> None:
        self.stack = stack
        self.every_s = every_s
        self.samples: list[tuple[float, str, int]] = []
        self.t0 = time.monotonic()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            now = time.monotonic() - self.t0
            for child in list(self.stack.children.values()):
                if child.proc.poll() is None:
                    rss = _rss_kib(child.proc.pid)
                    if rss:
                        self.samples.append((now, child.kind, rss))
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def quarters(self, since_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """Peak RSS per kind in the first and the last quarter of [since_s, end] (since_s: the first training step,
        so that start-up, imports and first-use loading, is not compared with the steady state)."""
        end = max((t for t, _, _ in self.samples), default=0.0)
        q = (end - since_s) / 4
        out: dict[str, dict[str, Any]] = {}
        for kind in PROCESS_KINDS:
            first = [r for t, k, r in self.samples if k == kind and since_s <= t <= since_s + q]
            last = [r for t, k, r in self.samples if k == kind and t >= end - q]
            if not first or not last:
                continue
            f, la = max(first), max(last)
            out[kind] = {"first_quarter_peak_kib": f, "last_quarter_peak_kib": la, "ratio": round(la / f, 3)}
            out[kind]["within_10pct"] = la <= 1.1 * f
        return out


# -- the driver -------------------------------------------------------------------------------------------------


class IngressClient:
    """Another service using the run meanwhile: submits a job through the HTTP ingress every `every_s` (a 503 while
    Redis is away is retried with the same job id), and at the end checks that every accepted job is done."""

    def __init__(self, port: int, every_s: float) -> None:
        import httpx

        self.base = f"http://127.0.0.1:{port}"
        self.every_s = every_s
        self.http = httpx.AsyncClient(timeout=5, headers={"Authorization": f"Bearer {INGRESS_TOKEN}"})
        self.accepted: list[str] = []
        self.refused = 0  # 503s and connection errors, each retried
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        import httpx

        i = 0
        while True:
            job_id = f"ing-{i}"
            try:
                resp = await self.http.post(f"{self.base}/v1/jobs", json={**INGRESS_JOB, "job_id": job_id})
                if resp.status_code == 202:
                    self.accepted.append(job_id)
                    i += 1
                else:
                    self.refused += 1
            except httpx.HTTPError:
                self.refused += 1
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def not_done(self, timeout_s: float = 60) -> list[str]:
        """The accepted jobs not done within `timeout_s` (they keep running after the trainer finished)."""
        import httpx

        left = list(self.accepted)
        deadline = time.monotonic() + timeout_s
        while left and time.monotonic() < deadline:
            still = []
            for job_id in left:
                try:
                    resp = await self.http.get(f"{self.base}/v1/jobs/{job_id}", params={"trajectories": "false"})
                    if resp.status_code != 200 or not resp.json()["done"]:
                        still.append(job_id)
                except httpx.HTTPError:
                    still.append(job_id)
            left = still
            if left:
                await asyncio.sleep(0.5)
        return left

    async def close(self) -> None:
        await self.stop()
        await self.http.aclose()


class Driver:
    def __init__(self, cfg: ChaosConfig, procs: Processes, tmp: Path, *, out: Any = None) -> None:
        self.cfg = cfg
        self.stack = Stack(cfg, procs, tmp)
        self.rng = random.Random(cfg.seed)
        self.faults: list[Fault] = []
        self.trainer_lives = 0
        self.resumes: list[str] = []
        self.out = out if out is not None else sys.stderr
        self.t0 = time.monotonic()
        self.redis: Any = None
        self.first_step_s: float | None = None  # since the RSS sampler started

    def say(self, msg: str) -> None:
        print(f"[chaos {time.monotonic() - self.t0:7.1f}s] {msg}", file=self.out, flush=True)

    def plan(self) -> list[tuple[int, str]]:
        """The step-triggered faults, interleaved and spread over 5%..60% of the run's steps."""
        counts = {
            "worker_stall": self.cfg.stalls,
            "engine_kill": self.cfg.engine_kills,
            "redis_kill": self.cfg.redis_kills,
            "trainer_kill": self.cfg.trainer_kills,
        }
        kinds: list[str] = []
        for round_ in range(max(counts.values(), default=0)):  # round robin over the kinds
            kinds += [k for k, n in counts.items() if n > round_]
        lo, hi = 0.05 * self.cfg.steps, 0.6 * self.cfg.steps
        gap = (hi - lo) / max(1, len(kinds) - 1)
        return [(max(1, round(lo + gap * i)), k) for i, k in enumerate(kinds)]

    async def start(self) -> None:
        s = self.stack
        if self.cfg.cluster:
            await s.start_cluster()
            self.redis = redis_client(s.url)
            await self.redis.set(RunKeys(s.run).partitions, self.cfg.partitions)  # before the auditor reads it
        else:
            await s.start_redis()
            self.redis = redis_client(s.url)
        for i in range(self.cfg.engines):
            await s.start_engine(i)
        self.auditor = Auditor(s.url, s.run, self.cfg.partitions if self.cfg.cluster else 1)
        await self.auditor.start()
        for _ in range(self.cfg.workers):
            await s.worker_registered(self.redis, s.start_worker())
        self.ingress_client: IngressClient | None = None
        if self.cfg.ingress_every_s > 0:
            ingress = await s.start_ingress()
            self.ingress_client = IngressClient(ingress.port, self.cfg.ingress_every_s)
            self.ingress_client.start()
        self.trainer = s.start_trainer(self.trainer_lives)
        self.trainer_lives += 1
        self.sampler = RssSampler(s, self.cfg.rss_every_s)
        self.sampler.start()
        self.t0 = time.monotonic()
        where = f"a 6-node cluster, {self.cfg.partitions} partitions" if self.cfg.cluster else "one redis-server"
        self.say(
            f"stack up: redis {s.url} ({where}, appendfsync {self.cfg.appendfsync}), engines {s.engine_urls}, "
            f"{self.cfg.workers} workers; training {self.cfg.steps} steps of {self.cfg.batch} samples"
        )

    def _record(self, kind: str, detail: str, started: float) -> None:
        f = Fault(kind, started - self.t0, self.stack.steps_done(), detail, time.monotonic() - started)
        self.faults.append(f)
        self.say(f"{kind}: {detail} (step {f.step}, recovered in {f.recovered_s:.1f}s)")

    # faults
    async def worker_kill(self) -> None:
        started = time.monotonic()
        victim = self.rng.choice(self.stack.live("worker"))
        self.stack.kill(victim)
        new = self.stack.start_worker()
        await self.stack.worker_registered(self.redis, new)
        self._record("worker_kill", f"{victim.name} SIGKILLed, {new.name} started", started)

    async def engine_kill(self) -> None:
        started = time.monotonic()
        victim = self.rng.choice(self.stack.live("engine"))
        self.stack.kill(victim)
        new = self.stack._start("engine", victim.name, victim.argv, victim.port)
        await self.stack.engine_ready(new)
        self._record("engine_kill", f"{victim.name} SIGKILLed, restarted on port {victim.port}", started)

    async def redis_kill(self) -> None:
        if self.cfg.cluster:
            await self.primary_kill()
            return
        started = time.monotonic()
        victim = self.stack.children["redis"]
        self.stack.kill(victim)
        await asyncio.sleep(self.cfg.redis_down_s)  # the outage being simulated, not a synchronisation
        await self.stack.start_redis()
        self._record("redis_kill", f"SIGKILLed, restarted from its AOF after {self.cfg.redis_down_s}s", started)

    async def primary_kill(self) -> None:
        """Cluster: SIGKILL a primary (the ledger's first, then the others in turn), wait for the failover, restart
        it (it rejoins as a replica of the promoted one)."""
        started = time.monotonic()
        cluster = self.stack.cluster
        kills = sum(f.kind == "redis_kill" for f in self.faults)
        ledger_home = cluster.primary_for(RunKeys(self.stack.run).ledger)
        others = sorted((n for n in cluster.primaries() if n is not ledger_home), key=lambda n: n.port)
        victim = ledger_home if kills % 3 == 0 or not others else others[(kills - 1) % len(others)]
        cluster.kill(victim)
        promoted = await asyncio.to_thread(cluster.wait_failover, victim, 30.0)
        failover_s = time.monotonic() - started
        await asyncio.to_thread(cluster.restart, victim)
        self.stack.sync_nodes()
        what = "the ledger's primary" if victim is ledger_home else "a primary"
        self._record(
            "redis_kill",
            f"{what} :{victim.port} SIGKILLed; replica :{promoted.port} took over in {failover_s:.1f}s; "
            f":{victim.port} rejoined as its replica",
            started,
        )

    async def trainer_kill(self) -> None:
        started = time.monotonic()
        victim = self.trainer
        self.stack.kill(victim)
        step = self.stack.steps_done()
        self.trainer = self.stack.start_trainer(self.trainer_lives)
        self.trainer_lives += 1

        def resumed() -> str | None:
            exited = self.trainer.proc.poll()  # before the log: a trainer that resumed and finished says so first
            for line in self.stack.tail(self.trainer).splitlines():
                if "resumed at step" in line or "starting at step" in line:
                    return line
            if exited is not None:
                raise BenchError(f"restarted trainer exited with {exited}: {self.stack.tail(self.trainer)}")
            return None

        line = await wait_until(resumed, 120, 0.1, "the restarted trainer to resume")
        self.resumes.append(line.strip())
        self._record(
            "trainer_kill", f"{victim.name} SIGKILLed at step ~{step}; {line.split('] ')[-1].strip()}", started
        )

    async def _pending(self) -> dict[str, int]:
        """Jobs pending per worker (consumer name), every job stream of the run."""
        status = await gather_status(self.redis, self.stack.run)
        out: Counter = Counter()
        for g in (g for stream in status.job_streams for g in stream.groups):
            for c in g.consumers:
                out[c.name] += c.pending
        return out

    async def _pending_of(self, name: str) -> int:
        return (await self._pending()).get(name, 0)

    async def worker_stall(self) -> None:
        started = time.monotonic()
        live = {w.name: w for w in self.stack.live("worker")}
        # one that holds jobs when it stops (workers idle while the ledger is full, between steps): bounded
        deadline = time.monotonic() + 20
        while True:
            if self.trainer.proc.poll() is not None:
                return  # the run is over: nothing left to stall
            holding = [name for name, n in (await self._pending()).items() if n > 0 and name in live]
            if not holding and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                continue
            victim = live[self.rng.choice(sorted(holding))] if holding else self.rng.choice(list(live.values()))
            victim.proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            held = await self._pending_of(victim.name)  # what it holds, frozen
            if held or time.monotonic() >= deadline:
                break
            victim.proc.send_signal(signal.SIGCONT)  # it finished them in the meantime: another try
        try:
            # past its lease: until the others reclaimed every job it held (and at least the lease itself)
            limit = 10 * self.cfg.lease_ms / 1000 + 10

            async def reclaimed() -> bool:
                past_lease = time.monotonic() - stopped >= 1.2 * self.cfg.lease_ms / 1000
                return past_lease and await self._pending_of(victim.name) == 0

            await wait_until(reclaimed, limit, 0.1, f"the jobs of stopped {victim.name} to be reclaimed")
            # optionally longer (part of the fault, not a synchronisation). With 0 the worker resumes as the
            # reclaimers run its jobs, so both copies of a sample tend to reach the trainer close together, while
            # it holds the first uncommitted (the case the trainer's collector must drop, not the consumer's dedup)
            if self.cfg.stall_extra_s:
                await asyncio.sleep(self.cfg.stall_extra_s)
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        self._record(
            "worker_stall",
            f"{victim.name} SIGSTOPped holding {held} jobs for {time.monotonic() - stopped:.1f}s "
            f"(lease {self.cfg.lease_ms} ms; all reclaimed), then SIGCONTed",
            started,
        )

    async def drive(self) -> int:
        """Inject faults until the trainer finishes; returns its exit code."""
        plan = self.plan()
        next_worker_kill = time.monotonic() + self.cfg.worker_kill_every_s
        deadline = self.t0 + self.cfg.timeout_s
        last_step, last_progress = 0, time.monotonic()
        while True:
            code = self.trainer.proc.poll()
            if code is not None:
                return code
            now = time.monotonic()
            if now > deadline:
                raise BenchError(
                    f"the run did not finish in {self.cfg.timeout_s:.0f}s (step {self.stack.steps_done()})"
                )
            step = self.stack.steps_done()
            if step != last_step:
                last_step, last_progress = step, now
                if self.first_step_s is None:
                    self.first_step_s = now - self.sampler.t0
            elif now - last_progress > 180:
                raise BenchError(f"no training step for 180s (stuck at step {step}): {self.stack.tail(self.trainer)}")
            if plan and step >= plan[0][0]:
                _, kind = plan.pop(0)
                await getattr(self, kind)()
            elif now >= next_worker_kill and self.cfg.worker_kill_every_s > 0:
                await self.worker_kill()
                next_worker_kill = time.monotonic() + self.cfg.worker_kill_every_s
            else:
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        client: IngressClient | None = getattr(self, "ingress_client", None)
        if client is not None:
            await client.close()
        for part in ("sampler", "auditor"):
            obj = getattr(self, part, None)
            if obj is not None:
                await (obj.stop() if part == "sampler" else obj.close())
        self.stack.kill_all()
        if self.redis is not None:
            await self.redis.aclose()


# -- accounting -------------------------------------------------------------------------------------------------


async def account(driver: Driver, trainer_code: int, seconds: float) -> dict[str, Any]:
    """Everything the run admitted, trained, dropped or left in flight, and the checks."""
    s, cfg = driver.stack, driver.cfg
    keys = RunKeys(s.run)
    redis = driver.redis
    await driver.auditor.drain()
    ingress = driver.ingress_client
    ingress_not_done: list[str] = []
    if ingress is not None:
        await ingress.stop()
        ingress_not_done = await ingress.not_done()
    ledger_raw = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.ledger)).items()}
    groups_raw = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.ledger_groups)).items()}
    # partial groups: group -> its failed samples, given back once (the group holds the rest)
    partial_raw = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.ledger_partial)).items()}
    status = await gather_status(redis, s.run)  # dead letters and dropped results of every partition
    dead, worker_dropped = status.dead_letters, status.dropped

    decoder = msgspec.json.Decoder()
    rows = [decoder.decode(ln) for ln in (s.run_dir / "trained.jsonl").read_bytes().splitlines() if ln.strip()]
    metrics = [decoder.decode(ln) for ln in (s.run_dir / "metrics.jsonl").read_bytes().splitlines() if ln.strip()]
    final = metrics[-1] if metrics else {}

    trained = Counter((r["job_id"], r["sample_index"]) for r in rows)
    twice = sorted(k for k, n in trained.items() if n > 1)
    per_group: dict[str, list[int]] = defaultdict(list)
    for job_id, idx in trained:
        per_group[job_id].append(idx)
    audit = driver.auditor

    def trained_as_recorded(g: str) -> bool:
        """Whole; or (a partial group) its survivors: at least partial_groups left, its failed samples given back
        and published as errors; or (a split group) the parts trained so far, its rest given back (dropped) or still
        in flight. Whatever is missing was given back or is in flight, as the ledger says."""
        idx = sorted(per_group[g])
        failed_back, rest_back = partial_raw.get(g, 0), partial_raw.get(rest_field(g), 0)
        rest_in_flight = groups_raw.get(g, 0) - len(idx)
        if idx == list(range(cfg.group_size)):
            return not failed_back and not rest_back and rest_in_flight == 0
        missing = set(range(cfg.group_size)) - set(idx)
        errors = sum((g, i) in audit.errors for i in missing)
        split = rest_back > 0 or rest_in_flight > 0
        return (
            rest_in_flight >= 0
            and failed_back + rest_back + rest_in_flight == len(missing)
            and (not failed_back or (cfg.partial_groups > 0 and errors >= failed_back))
            and (split or len(idx) >= cfg.partial_groups)
            and (not split or cfg.split_groups > 0)
        )

    incomplete = sorted(g for g in per_group if not trained_as_recorded(g))
    # split groups whose rest was given back, or is still in flight
    rest_dropped = sum(rest_field(g) in partial_raw for g in per_group)
    rest_in_flight = sum(groups_raw.get(g, 0) > len(idx) for g, idx in per_group.items())
    # trained on survivors: failed samples given back, the rest trained
    partial_trained = sum(g in partial_raw and rest_field(g) not in partial_raw for g in per_group)
    split_parts = sum(m.get("split_parts", 0) for m in metrics)
    from tests.chaos.failing_reward import fails

    injected = {(g, i) for g in groups_raw for i in range(cfg.group_size) if fails(g, i, cfg.fail_rate)}
    failing_trained = sorted(k for k in trained if k in injected)
    tokens = _audit_tokens(rows, audit.token_versions, cfg.max_staleness)
    metric_tokens = {
        "trained": sum(m.get("trained_tokens", 0) for m in metrics),
        "masked": sum(m.get("masked_tokens", 0) for m in metrics),
        "generated": sum(m.get("trained_sample_tokens", 0) for m in metrics),  # of the samples trained
    }
    staleness = [r["version"] - r["oldest"] for r in rows if r["oldest"] is not None]  # of the tokens trained
    future = [r for r in rows if r["oldest"] is not None and r["oldest"] > r["version"]]
    max_staleness = max(staleness, default=0)

    trained_groups = set(per_group)
    released = {g for g, n in groups_raw.items() if n == 0}
    held = {g for g, n in groups_raw.items() if n > 0}
    admitted_samples = cfg.group_size * len(groups_raw)
    # Drops by reason as the ledger counted them with each give-back (durable; the trainer's own count in
    # metrics.jsonl rolls back with its checkpoint when it is killed, so it may miss drops made just before).
    dropped = {k.removeprefix("released:"): v for k, v in ledger_raw.items() if k.startswith("released:") and v}
    dropped_admitted = sum(dropped.values())
    # a partial group holds its survivors only; a split group part-trained holds its rest in flight too
    in_flight = sum(groups_raw[g] - len(per_group.get(g, ())) for g in held)
    checks = {
        "run_finished": trainer_code == 0 and final.get("step") == cfg.steps,
        # a group is listed once per step that trained some of it: each split part adds a listing, unless the rest
        # after it was dropped or is still in flight
        "nothing_trained_twice": not twice
        and len(set(sum(([g for g in m["groups"]] for m in metrics), [])))
        == sum(len(m["groups"]) for m in metrics) - split_parts + rest_dropped + rest_in_flight,
        "trained_groups_whole_or_partial": not incomplete,
        "trained_only_admitted": trained_groups <= held,
        "dropped_never_trained": not (trained_groups & released),
        "every_admitted_accounted": admitted_samples == len(trained) + dropped_admitted + in_flight
        and ledger_raw.get("released", 0) == dropped_admitted,
        "trained_count_matches": len(trained) == final.get("trained_samples", -1),
        "staleness_within_bound": max_staleness <= cfg.max_staleness
        and not future
        and all(m["staleness_max"] <= cfg.max_staleness for m in metrics),
        # the versions the workers generated, per trained sample: what is older than v - eta was masked (nothing
        # under `drop`), nothing is newer than v, and the totals are the trainer's
        # (a Cluster failover may lose a trajectory after the trainer read it and before the auditor did: there
        # the totals are compared only when the auditor saw every trained sample)
        "tokens_match_audit": (tokens["unaudited"] == 0 or cfg.cluster)
        and tokens["future"] == 0
        and (cfg.stale_policy == "mask" or tokens["older_min"] == 0)
        and (
            tokens["unaudited"] > 0
            or (
                tokens["generated_min"] <= metric_tokens["generated"] <= tokens["generated_max"]
                and tokens["older_min"] <= metric_tokens["masked"] <= tokens["older_max"]
            )
        )
        and metric_tokens["trained"] + metric_tokens["masked"] == metric_tokens["generated"],
        "failed_samples_never_trained": not failing_trained,
        # the ledger's limit, (eta + v + 1) x B net of give-backs, less what was trained (fewer than v x B samples
        # when partial groups trained: their failed samples were given back)
        "in_flight_bounded": in_flight + len(trained) <= (cfg.max_staleness + final.get("step", 0) + 1) * cfg.batch,
        "every_fault_fired": all(
            any(f.kind == k for f in driver.faults)
            for k, n in zip(
                FAULT_KINDS,
                (cfg.worker_kill_every_s, cfg.engine_kills, cfg.redis_kills, cfg.trainer_kills, cfg.stalls),
                strict=True,
            )
            if n
        ),
        "trainer_resumed_from_checkpoint": all("resumed at step" in r for r in driver.resumes),
        "ingress_jobs_all_done": not ingress_not_done,
    }
    if cfg.fail_rate:  # the injected failures happened and went back to the ledger as `failed`
        checks["failures_given_back"] = bool(dropped.get("failed")) and dead > 0 and bool(injected & audit.errors)
    if cfg.partial_groups:  # the trained log's partial groups are those the trainer's metrics count, and some trained
        checks["partial_groups_trained"] = partial_trained == sum(m.get("partial_groups", 0) for m in metrics) and (
            partial_trained > 0 or not cfg.fail_rate
        )
    # A long tail under `mask` with whole groups: some tokens really were masked. With split groups and late joins a
    # run often masks none (what they are for), so there the audit's agreement (tokens_match_audit) is the check.
    if cfg.stale_policy == "mask" and cfg.long_tail and not (cfg.split_groups or cfg.join_late):
        checks["tokens_masked"] = metric_tokens["masked"] > 0
    rss = driver.sampler.quarters(driver.first_step_s or 0.0)
    held_copies = 0  # copies of samples the trainer held uncommitted, which its collector dropped (its log says so)
    reoffered = 0  # groups whose submission Redis lost, queued again by the trainer's feeder
    for path in s.procs.log_dir.glob("trainer*.log"):
        text = path.read_bytes()
        held_copies += text.count(b"dropped a duplicate of sample")
        reoffered += text.count(b"vanished from Redis")
    return {
        "run": s.run,
        "seconds": round(seconds, 1),
        "steps": final.get("step", 0),
        "episodes_trained": len(trained),
        "batch": cfg.batch,
        "appendfsync": cfg.appendfsync,
        "redis": f"cluster of 6, {cfg.partitions} partitions" if cfg.cluster else "one redis-server",
        "samples_admitted": admitted_samples,
        "samples_trained": len(trained),
        "groups_trained": len(per_group),
        "samples_trained_twice": len(twice),
        "dropped_by_trainer": dropped,
        "dropped_in_trainer_metrics": {k: v for k, v in final.get("dropped", {}).items() if v},
        "dead_letters": dead,
        "dropped_by_workers": worker_dropped,
        "in_flight_at_end": in_flight,
        "duplicates_dropped_by_consumers": driver.auditor.duplicates,
        "duplicates_dropped_by_trainer_collector": held_copies,
        "groups_reoffered": reoffered,
        "stale_policy": cfg.stale_policy,
        "tokens": {**metric_tokens, "dropped": sum(m.get("dropped_tokens", 0) for m in metrics)},
        "tokens_audit": tokens,
        "length_dist": f"{cfg.length_dist}, max {cfg.max_new_tokens}, {cfg.token_latency_s * 1000:g} ms/token",
        "partial_groups": sum(m.get("partial_groups", 0) for m in metrics),
        "partial_groups_trained": partial_trained,
        "partial_groups_min": cfg.partial_groups,
        "split_parts": split_parts,
        "split_groups_rest_given_back": rest_dropped,
        "split_groups_rest_in_flight": rest_in_flight,
        "split_groups_min": cfg.split_groups,
        "late_samples": sum(m.get("late_samples", 0) for m in metrics),
        "partial_samples_given_back": sum(n for k, n in partial_raw.items() if not k.endswith(rest_field(""))),
        "fail_rate": cfg.fail_rate,
        "samples_failing_injected": len(injected),
        "samples_published_as_error": len(audit.errors),
        "samples_failing_trained": len(failing_trained),
        "failing_trained_examples": [list(k) for k in failing_trained[:5]],
        "ingress_jobs_accepted": len(ingress.accepted) if ingress else 0,
        "ingress_jobs_not_done": len(ingress_not_done),
        "ingress_refusals_retried": ingress.refused if ingress else 0,
        "published": dict(driver.auditor.statuses),
        "faults": dict(Counter(f.kind for f in driver.faults)),
        "faults_planned": dict(Counter(kind for _, kind in driver.plan())),  # step-triggered; worker kills: by time
        "max_staleness_observed": max_staleness,
        "max_staleness_bound": cfg.max_staleness,
        "staleness_hist": dict(sorted(Counter(staleness).items())),
        "ledger": ledger_raw,
        "rss": rss,
        "rss_within_10pct": all(v["within_10pct"] for v in rss.values()),
        "checks": checks,
        "ok": all(checks.values()),
        "twice_examples": [list(k) for k in twice[:5]],
        "incomplete_examples": incomplete[:5],
    }


def _audit_tokens(
    rows: list[dict[str, Any]], copies: dict[tuple[str, int], set[tuple[tuple[int, int], ...]]], eta: int
) -> dict[str, int]:
    """The generated tokens of the trained samples as the auditor saw them published, against the version each was
    trained at (v): in total, older than v - eta (what `mask` must have masked) and newer than v. A sample published
    in several distinct copies (generated again after its worker's lease passed) gives a range: min and max over
    them."""
    out = dict.fromkeys(
        ("samples", "ambiguous", "unaudited", "generated_min", "generated_max", "older_min", "older_max", "future"), 0
    )
    for r in rows:
        seen = copies.get((r["job_id"], r["sample_index"]))
        if not seen:
            out["unaudited"] += 1
            continue
        out["samples"] += 1
        out["ambiguous"] += len(seen) > 1
        floor, version = r["version"] - eta, r["version"]
        generated = [sum(n for _, n in copy) for copy in seen]
        older = [sum(n for v, n in copy if v < floor) for copy in seen]
        out["generated_min"] += min(generated)
        out["generated_max"] += max(generated)
        out["older_min"] += min(older)
        out["older_max"] += max(older)
        out["future"] += min(sum(n for v, n in copy if v > version) for copy in seen)
    return out


def table(report: dict[str, Any]) -> str:
    """The accounting table."""
    lines = [
        f"chaos soak: {report['steps']} steps, {report['episodes_trained']} episodes in {report['seconds']:.0f} s "
        f"(Redis: {report['redis']}, AOF appendfsync {report['appendfsync']})",
        f"  {'samples admitted (ledger)':<40} {report['samples_admitted']:>8}",
        f"  {'trained (exactly once)':<40} {report['samples_trained']:>8}",
        f"  {'trained twice':<40} {report['samples_trained_twice']:>8}",
    ]
    for reason, n in sorted(report["dropped_by_trainer"].items()):
        lines.append(f"  {'dropped by the trainer: ' + reason:<40} {n:>8}")
    lines.append(f"  {'in flight when the run finished':<40} {report['in_flight_at_end']:>8}")
    lines.append(f"  {'dead letters (-> failed)':<40} {report['dead_letters']:>8}")
    for reason, n in sorted(report["dropped_by_workers"].items()):
        lines.append(f"  {'dropped by workers: ' + reason:<40} {n:>8}")
    lines.append(f"  {'duplicate trajectories (audit consumer)':<40} {report['duplicates_dropped_by_consumers']:>8}")
    lines.append(
        f"  {'  of which held copies the trainer dropped':<40} {report['duplicates_dropped_by_trainer_collector']:>8}"
    )
    lines.append(f"  {'groups re-offered (submission lost)':<40} {report['groups_reoffered']:>8}")
    if report["fail_rate"]:
        lines.append(
            f"  {'failing samples (fail rate ' + format(report['fail_rate'], 'g') + ')':<40} "
            f"{report['samples_failing_injected']:>8}   (of the admitted groups; published as error: "
            f"{report['samples_published_as_error']}, trained: {report['samples_failing_trained']})"
        )
    if report["partial_groups_min"]:
        lines.append(
            f"  {'partial groups trained (>= ' + str(report['partial_groups_min']) + ' survivors)':<40} "
            f"{report['partial_groups_trained']:>8}   (metrics: {report['partial_groups']}; their failed samples "
            f"given back: {report['partial_samples_given_back']})"
        )
    if report["split_groups_min"]:
        lines.append(
            f"  {'parts trained ahead of stragglers':<40} {report['split_parts']:>8}   (groups whose rest was "
            f"given back afterwards: {report['split_groups_rest_given_back']}, in flight at the end: "
            f"{report['split_groups_rest_in_flight']})"
        )
    if report["late_samples"]:
        lines.append(f"  {'samples that joined a step late':<40} {report['late_samples']:>8}")
    tok, audit = report["tokens"], report["tokens_audit"]
    lines.append(
        f"  {'tokens trained / masked / dropped':<40} {tok['trained']:>8} / {tok['masked']} / {tok['dropped']}"
        f"   (stale policy {report['stale_policy']}; lengths {report['length_dist']})"
    )

    def span(lo: int, hi: int) -> str:
        return str(lo) if lo == hi else f"{lo}..{hi}"

    lines.append(
        f"  {'  audit: generated / older than v-eta':<40} {span(audit['generated_min'], audit['generated_max']):>8}"
        f" / {span(audit['older_min'], audit['older_max'])}   (trainer: {tok['generated']} / {tok['masked']}; "
        f"newer than v: {audit['future']}; samples {audit['samples']}, {audit['ambiguous']} in several copies, "
        f"{audit['unaudited']} unseen)"
    )
    lines.append(
        f"  {'ingress jobs accepted / not done':<40} {report['ingress_jobs_accepted']:>8} / "
        f"{report['ingress_jobs_not_done']}   ({report['ingress_refusals_retried']} refusals retried)"
    )
    for kind in FAULT_KINDS:
        planned = report["faults_planned"].get(kind)
        of = (
            f" (of {planned} planned: the run finished first)"
            if planned and planned > report["faults"].get(kind, 0)
            else ""
        )
        lines.append(f"  {'faults: ' + kind:<40} {report['faults'].get(kind, 0):>8}{of}")
    lines.append(
        f"  {'max staleness observed / bound':<40} {report['max_staleness_observed']:>4} / "
        f"{report['max_staleness_bound']}"
        f"   histogram {report['staleness_hist']}"
    )
    lines.append(f"  {'peak RSS (KiB)':<40} {'1st quarter':>12} {'last quarter':>13} {'ratio':>6}  within 10%")
    for kind, r in report["rss"].items():
        lines.append(
            f"  {'  ' + kind:<40} {r['first_quarter_peak_kib']:>12} {r['last_quarter_peak_kib']:>13} "
            f"{r['ratio']:>6}  {'yes' if r['within_10pct'] else 'NO'}"
        )
    lines.append("  checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in report["checks"].items()))
    return "\n".join(lines)


async def run_chaos(cfg: ChaosConfig, procs: Processes, tmp: Path, *, out: Any = None) -> dict[str, Any]:
    """The whole soak: start the stack, drive faults until the trainer finishes, account. Every process it started
    is SIGKILLed before it returns (or raises)."""
    cfg.validate()
    driver = Driver(cfg, procs, tmp, out=out)
    started = time.monotonic()
    try:
        await driver.start()
        code = await driver.drive()
        if code != 0:
            driver.say(f"the trainer exited with {code}: {driver.stack.tail(driver.trainer)}")
        await driver.sampler.stop()
        return await account(driver, code, time.monotonic() - started)
    finally:
        await driver.close()


# -- main -------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = ChaosConfig()
    p = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=d.episodes, help=f"samples to train (default {d.episodes})")
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    p.add_argument("--max-staleness", type=int, default=d.max_staleness, help="eta (default 2)")
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="jobs per worker")
    p.add_argument(
        "--worker-kill-every",
        type=float,
        default=d.worker_kill_every_s,
        metavar="S",
        help="SIGKILL a random worker every S seconds (0: never)",
    )
    p.add_argument("--engine-kills", type=int, default=d.engine_kills)
    p.add_argument("--redis-kills", type=int, default=d.redis_kills)
    p.add_argument("--trainer-kills", type=int, default=d.trainer_kills)
    p.add_argument("--stalls", type=int, default=d.stalls, help="worker SIGSTOP past its lease, then SIGCONT")
    p.add_argument("--lease-ms", type=int, default=d.lease_ms, help="the workers' lease")
    p.add_argument(
        "--stall-extra-s", type=float, default=d.stall_extra_s, help="stalled this long after the jobs were reclaimed"
    )
    p.add_argument("--redis-down-s", type=float, default=d.redis_down_s, help="how long Redis stays away")
    p.add_argument("--appendfsync", choices=["always", "everysec"], default=d.appendfsync)
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="bound on the whole run (s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--stale-policy", choices=["drop", "mask"], default=d.stale_policy, help="the trainer's")
    p.add_argument(
        "--length-dist",
        default=d.length_dist,
        metavar="SPEC",
        help="the engines' output lengths: fixed | uniform:LOW:HIGH | lognormal:MEDIAN:SIGMA | pareto:XMIN:ALPHA "
        "(e.g. pareto:16:1.2, with --max-new-tokens 512)",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=d.max_new_tokens, help=f"cap on an answer (default {d.max_new_tokens})"
    )
    p.add_argument(
        "--token-latency",
        type=float,
        default=d.token_latency_s,
        metavar="S",
        help=f"the engines' seconds per decode step (default {d.token_latency_s})",
    )
    p.add_argument(
        "--fail-rate",
        type=float,
        default=d.fail_rate,
        metavar="P",
        help="fraction of samples whose reward fails on every attempt (dead-lettered as error trajectories)",
    )
    p.add_argument(
        "--partial-groups",
        type=int,
        default=d.partial_groups,
        metavar="N",
        help="the trainer's: a group with failed samples trains on its survivors when >= N are left (0: off)",
    )
    p.add_argument(
        "--split-groups",
        type=int,
        default=d.split_groups,
        metavar="N",
        help="the trainer's: a group's finished samples train ahead of its stragglers once >= N finished (0: off)",
    )
    p.add_argument(
        "--join-late",
        action="store_true",
        help="the trainer's: what finishes while a step trains and would pass the bound joins that step",
    )
    p.add_argument("--cluster", action="store_true", help="a six-node Redis Cluster; redis_kill kills a primary")
    p.add_argument("--partitions", type=int, default=d.partitions, help="the run's partitions with --cluster")
    p.add_argument("--cluster-node-timeout", type=int, default=d.cluster_node_timeout_ms, metavar="MS")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> ChaosConfig:
    return ChaosConfig(
        episodes=args.episodes,
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        max_staleness=args.max_staleness,
        workers=args.workers,
        engines=args.engines,
        concurrency=args.concurrency,
        worker_kill_every_s=args.worker_kill_every,
        engine_kills=args.engine_kills,
        redis_kills=args.redis_kills,
        trainer_kills=args.trainer_kills,
        stalls=args.stalls,
        lease_ms=args.lease_ms,
        stall_extra_s=args.stall_extra_s,
        redis_down_s=args.redis_down_s,
        appendfsync=args.appendfsync,
        timeout_s=args.timeout,
        seed=args.seed,
        cluster=args.cluster,
        stale_policy=args.stale_policy,
        length_dist=args.length_dist,
        max_new_tokens=args.max_new_tokens,
        token_latency_s=args.token_latency,
        fail_rate=args.fail_rate,
        partial_groups=args.partial_groups,
        split_groups=args.split_groups,
        join_late=args.join_late,
        partitions=args.partitions,
        cluster_node_timeout_ms=args.cluster_node_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from(args)
    failed: list[str] = []

    async def run(procs: Processes, tmp: Path) -> None:
        report = await run_chaos(cfg, procs, tmp)
        print(table(report))
        failed.extend(k for k, v in report["checks"].items() if not v)
        print_summary(report)

    code = run_bench(run, "rollq-chaos-")
    if code == 0 and failed:
        print(f"soak failed: checks {', '.join(failed)}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ChaosConfig", "Driver", "FAULT_KINDS", "account", "run_chaos", "table"]
