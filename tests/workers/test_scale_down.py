"""Scale-down loses nothing: `rollq worker` subprocesses SIGTERMed mid-episode under load, as Kubernetes stops a pod
(KEDA scaling the worker Deployment down, a rollout, a node drain), while the others keep running and new ones start.

Episodes (tests.workflows:Echo) take 0.6 s or 3 s, the drain grace is 1 s: of what a stopped worker runs, some
finishes within the grace and is published by it, the rest is handed back. The lease is 120 s, far beyond the test:
a handed-back job that starts again within seconds was redelivered by the hand-back, not by a lease running out.
Counted through the trainer's own consume path (ResultConsumer: COMMIT and its consumed sets) and, independently, on
the results stream itself (an audit group that never reads keeps every published entry there).

The hand-back time of each job is its REQUEUE's new entry id (Redis's clock: the worker logs it), its redelivery
the `started_at` of the run that finished it; both printed (`-s`) for the closing note."""

from __future__ import annotations

import asyncio
import functools
import re
import statistics
import time
from dataclasses import dataclass

import pytest

from rollq.local import wait_until
from rollq.producer import JobRequest, Producer
from rollq.protocol.keys import WORKER_GROUP, RunKeys
from rollq.redis_client import ensure_group
from rollq.workers.worker import HAND_BACK_S
from tests.helpers import WorkerProcess, wait_registered

GRACE_S = 1.0
LEASE_MS = 120_000
EXIT_BOUND_S = GRACE_S + HAND_BACK_S + 5  # what the worker bounds (grace, hand-back), plus its own close
SHORT_S, LONG_S = 0.6, 3.0
HANDED_BACK = re.compile(r"handed back job (\S+)#(\d+): entry \S+ of \S+, queued again as (\d+)-\d+")


@dataclass
class Stopped:
    worker: WorkerProcess
    sigterm_at: float
    exited_at: float = 0.0
    code: int | None = None

    @property
    def exit_s(self) -> float:
        return self.exited_at - self.sigterm_at


async def busy(redis, stream: str, workers: list[WorkerProcess], count: int, at_least: int) -> list[WorkerProcess]:
    """`count` of `workers` that each hold (have pending) at least `at_least` entries, busiest first; [] while fewer
    do."""
    summary = await redis.xpending(stream, WORKER_GROUP)
    held = {c["name"].decode(): int(c["pending"]) for c in summary["consumers"]}
    ready = sorted((w for w in workers if held.get(w.name, 0) >= at_least), key=lambda w: -held[w.name])
    return ready[:count] if len(ready) >= count else []


async def scale_down(
    redis, redis_url, run, spawn_worker, *, wave: int, first: int, rounds, concurrency: int, redelivered_in: float
):
    """`first` workers; each round submits `wave` jobs (2 samples each), SIGTERMs `stop` workers once each holds at
    least two running jobs, starts `start` new ones at once, and lets the stopped ones exit before the next round
    (others keep running what they hold). Every handed-back job must start again within `redelivered_in` seconds.
    Returns (trajectories, stopped workers, redelivery seconds)."""
    keys = RunKeys(run)
    producer = Producer(redis, run)
    consumer = producer.consumer()
    await consumer.setup()
    await ensure_group(redis, producer.reply_to, "audit")  # never reads: the stream keeps all that was published
    args = ["--concurrency", str(concurrency), "--drain-grace", str(GRACE_S), "--lease-ms", str(LEASE_MS)]
    live = [spawn_worker(redis_url, run, *args) for _ in range(first)]
    for w in live:
        await wait_registered(redis, run, w.name, timeout_s=60)
    jobs = wave * len(rounds)
    expected = {f"j{i}": 2 for i in range(jobs)}

    async def collect():
        return [t async for t in producer.wait_for(expected, timeout_s=120, consumer=consumer)]

    collecting = asyncio.create_task(collect())
    stopped: list[Stopped] = []

    async def exited(s: Stopped) -> None:
        s.code = await asyncio.to_thread(s.worker.proc.wait)
        s.exited_at = time.time()

    for r, (stop, start) in enumerate(rounds):
        await producer.submit_many(
            [
                JobRequest(
                    workflow="tests.workflows:Echo",
                    data={"i": i, "sleep": LONG_S if i % 2 else SHORT_S},
                    n=2,
                    job_id=f"j{i}",
                )
                for i in range(r * wave, (r + 1) * wave)
            ]
        )
        # Mid-episode: each victim holds at least two running jobs.
        pick = functools.partial(busy, redis, keys.jobs, list(live), stop, 2)
        victims = await wait_until(pick, 30, what=f"{stop} busy workers")
        now: list[Stopped] = []
        for v in victims:
            v.terminate()
            now.append(Stopped(v, time.time()))
            live.remove(v)
        live += [spawn_worker(redis_url, run, *args) for _ in range(start)]
        await asyncio.wait_for(asyncio.gather(*(exited(s) for s in now)), EXIT_BOUND_S + 30)
        stopped += now
    trajs = await collecting

    # Exactly once: every sample delivered once to the consumer, none dropped as a duplicate, none published twice.
    assert sorted((t.job_id, t.sample_index) for t in trajs) == sorted((j, s) for j in expected for s in range(2))
    assert consumer.duplicates_dropped == 0
    assert await redis.xlen(producer.reply_to) == 2 * jobs
    assert all(t.status == "ok" for t in trajs)
    assert await redis.xlen(keys.jobs) == 0 and (await redis.xpending(keys.jobs, WORKER_GROUP))["pending"] == 0

    # Each stopped worker exited cleanly within its bound, having published some jobs in its grace and handed back
    # the others (over the rounds).
    for s in stopped:
        assert s.code == 0, s.worker.output()[-3000:]
        assert s.exit_s < EXIT_BOUND_S, (s.worker.name, s.exit_s)
    finished_in_grace = [
        t for s in stopped for t in trajs if t.worker_id == s.worker.name and t.finished_at > s.sigterm_at
    ]
    handed: dict[tuple[str, int], list[tuple[float, str]]] = {}
    for s in stopped:
        for job_id, idx, ms in HANDED_BACK.findall(s.worker.output()):
            handed.setdefault((job_id, int(idx)), []).append((int(ms) / 1000, s.worker.name))
    assert handed, "no job was handed back: the victims finished everything within the grace"
    assert finished_in_grace, "no job finished within a grace: the victims handed everything back"

    # Redelivered by the hand-back: started again (elsewhere, as a first attempt) soon after, far within the lease.
    by_sample = {(t.job_id, t.sample_index): t for t in trajs}
    redelivery = []
    for sample, backs in handed.items():
        t = by_sample[sample]
        at, by = max(backs)  # the last hand-back (a job can be handed back by two victims in turn)
        assert t.worker_id != by and t.attempt == 1, (sample, t.worker_id, t.attempt)
        assert t.started_at >= at - 0.05, (sample, t.started_at, at)  # (clocks: Redis's ms vs the worker's)
        redelivery.append(max(0.0, t.started_at - at))
    assert max(redelivery) < redelivered_in, redelivery
    exits_s = [round(s.exit_s, 2) for s in stopped]
    print(
        f"\nscale-down: {len(stopped)} workers SIGTERMed over {len(rounds)} rounds (grace {GRACE_S:g} s, lease "
        f"{LEASE_MS / 1000:g} s), {2 * jobs} samples: 0 lost, 0 twice; {len(finished_in_grace)} published within a "
        f"grace, {sum(len(b) for b in handed.values())} hand-backs; exit after SIGTERM (s): {exits_s}; redelivery "
        f"after hand-back (s): min {min(redelivery):.3f}, median {statistics.median(redelivery):.3f}, max "
        f"{max(redelivery):.3f}"
    )
    return trajs, stopped, redelivery


pytestmark = pytest.mark.slow


async def test_workers_sigtermed_mid_episode_under_load_lose_nothing_and_hand_back_at_once(
    redis, redis_url, run_name, spawn_worker
):
    # Three workers with room to spare (36 slots, a wave of 12 samples a round), so a handed-back job's wait is the
    # hand-back itself. Three rounds each stop the busiest worker; the first two start a new one.
    rounds = [(1, 1), (1, 1), (1, 0)]
    await scale_down(
        redis, redis_url, run_name, spawn_worker, wave=6, first=3, rounds=rounds, concurrency=12, redelivered_in=30
    )


@pytest.mark.scenario
async def test_scale_down_soak(redis, redis_url, run_name, spawn_worker):
    """Longer and saturated (about 16 slots, a wave of 24 samples a round): eight rounds of 1-2 workers stopped at
    once and 1-2 started. A
    handed-back job goes to the tail of its stream, so here its redelivery includes its wait behind what was queued
    before it (about 20 s on a 2-core machine): bounded by the backlog, not by the lease."""
    rounds = [(1, 1), (2, 2), (1, 2), (2, 1), (1, 1), (2, 2), (1, 1), (2, 1)]
    await scale_down(
        redis,
        redis_url,
        run_name,
        spawn_worker,
        wave=12,
        first=4,
        rounds=rounds,
        concurrency=4,
        redelivered_in=LEASE_MS / 1000,
    )
