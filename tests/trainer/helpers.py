"""Helpers of the trainer tests: the rollout stack's engine arguments and workflow, and the Auditor that reads every
trajectory of a run through its own consumer group (the fixtures that start them are in conftest.py)."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path

from rollq.producer.results import ResultConsumer
from rollq.protocol.keys import RunKeys
from rollq.protocol.messages import Trajectory
from rollq.trainer.batch import trained_versions
from tests.helpers import wait_until

# Heavy-ish tails and real queueing: lognormal lengths, a decode step every 2 ms, 8 slots per engine.
ENGINE_ARGS = (
    "--tokenizer",
    "tiny",
    "--sampled",
    "--length-dist",
    "lognormal:10:1.0",
    "--token-latency",
    "0.002",
    "--max-running",
    "8",
)
WORKFLOW_KWARGS = {"reward_fn": "rollq.tasks.digits:digits_reward", "max_new_tokens": 48}


class Auditor:
    """Every trajectory of a run, as published, read through a consumer group of its own."""

    def __init__(self, redis, run: str) -> None:
        self.consumer = ResultConsumer(redis, RunKeys(run).results, group="audit", name="audit", release_inflight=False)
        self.seen: dict[str, list[Trajectory]] = defaultdict(list)
        self._task: asyncio.Task | None = None

    async def start(self) -> Auditor:
        await self.consumer.setup()  # before anything is published: it sees the whole run
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        while True:
            batch = await self.consumer.read(count=512, block_ms=200)
            for d in batch:
                self.seen[d.trajectory.job_id].append(d.trajectory)
            await self.consumer.commit(batch)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def check_trained(self, records: list[dict], group_size: int, eta: int) -> None:
        """Each trained group: once in the run, all `group_size` samples ok, every trained token's version within
        [v - eta, v] where v is the policy version the step trained (step - 1)."""
        trained = [(r["step"], g) for r in records for g in r["groups"]]
        assert len({g for _, g in trained}) == len(trained), "a group was trained twice"
        for step, group in trained:
            samples = self.seen[group]
            assert sorted(t.sample_index for t in samples) == list(range(group_size)), group
            assert all(t.status == "ok" for t in samples), group
            versions = [int(v) for t in samples for s in t.sequences for v in trained_versions(s)]
            assert versions and step - 1 - eta <= min(versions) and max(versions) <= step - 1, (group, step, versions)

    def has(self, groups: list[str], group_size: int) -> bool:
        return all(len(self.seen[g]) >= group_size for g in groups)

    async def check_run(self, metrics: Path, *, steps: int, group_size: int, groups_per_step: int, eta: int) -> list:
        """A run's metrics.jsonl after restarts: each step once, versions 1..steps, every sample trained, the bound
        held at each step, and `check_trained` once the auditor has read every trained group. Returns the records."""
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, steps + 1))  # each step once: redone steps replaced
        assert [r["version"] for r in records] == list(range(1, steps + 1))
        assert records[-1]["trained_samples"] == steps * group_size * groups_per_step
        for r in records:
            assert r["staleness_max"] <= eta and r["ledger_admitted"] <= r["ledger_limit"]
        trained = [g for r in records for g in r["groups"]]
        await wait_until(lambda: self.has(trained, group_size), 20, what="the auditor to read every trained group")
        self.check_trained(records, group_size=group_size, eta=eta)
        return records
