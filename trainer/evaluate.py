"""Held-out evaluation during a run: every prompt of `eval_dataset` once, as an evaluation job (`is_eval`, the
workflow's kwargs with `eval_workflow_kwargs` over them, e.g. greedy decoding) run by the workers like any other job,
its result read back from a private reply stream. Engine requests carry a high priority, so an evaluation is served
before the training backlog; the trainer waits for it at a step boundary, so every token is of the version
evaluated."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from rollq.producer.producer import JobRequest, Producer
from rollq.producer.results import PartitionedConsumer, ResultConsumer
from rollq.protocol.keys import RunKeys
from rollq.trainer.data import load_prompts
from rollq.trainer.metrics import EvalRecord

log = logging.getLogger("rollq.trainer")

EVAL_PRIORITY = 1 << 20  # engines schedule larger first: ahead of every training request
REPLY_TTL_S = 3600  # the reply stream outlives a killed trainer by this much, then expires


class Evaluator:
    def __init__(
        self,
        redis: aioredis.Redis,
        run: str,
        *,
        dataset: str | list[dict[str, Any]],  # a dataset setting, or its records (trainer.data.run_prompts)
        workflow: str,
        workflow_kwargs: dict[str, Any],
        partitions: int = 0,
        timeout_s: float = 600.0,
    ) -> None:
        self.prompts = load_prompts(dataset) if isinstance(dataset, str) else dataset
        self.workflow = workflow
        self.workflow_kwargs = workflow_kwargs
        self.timeout_s = timeout_s
        name = f"eval-{uuid.uuid4().hex[:12]}"
        self.producer = Producer(
            redis, run, reply_to=RunKeys(run).reply_stream(name), reply_ttl_s=REPLY_TTL_S, partitions=partitions
        )
        self._consumer: ResultConsumer | PartitionedConsumer | None = None

    async def evaluate(self, step: int, version: int, lora: str = "") -> EvalRecord:
        """Evaluate policy `version` (a LoRA run's: its adapter `lora`, loaded on the engines)."""
        started = time.monotonic()
        if self._consumer is None:
            await self.producer.partitions()
            self._consumer = self.producer.consumer(group="eval", name="trainer")
        # Every time, before any worker can publish: the stream and its group may have expired since the last one
        # (REPLY_TTL_S without an evaluation); both calls are no-ops when they exist.
        await self.producer.keep_reply_stream()
        await self._consumer.setup()
        tag = uuid.uuid4().hex[:8]  # fresh ids: a restarted trainer's evaluation is a new one
        requests = [
            JobRequest(
                workflow=self.workflow,
                data=record,
                job_id=f"eval-{tag}-{i}",
                workflow_kwargs=self.workflow_kwargs,
                is_eval=True,
                priority=EVAL_PRIORITY,
                lora=lora,
            )
            for i, record in enumerate(self.prompts)
        ]
        results = await self.producer.submit_many(requests)
        rewards: list[float] = []
        failed = 0
        versions: set[int] = set()
        try:
            expected = {r.job_id: 1 for r in results}
            async for traj in self.producer.wait_for(expected, timeout_s=self.timeout_s, consumer=self._consumer):
                if traj.status == "ok":
                    rewards.append(sum(s.reward for s in traj.sequences) / max(1, len(traj.sequences)))
                    versions.update(int(v) for s in traj.sequences for v in s.versions if v >= 0)
                else:
                    failed += 1
        except TimeoutError as exc:
            log.warning("evaluation after step %d incomplete: %s (missing ones count 0)", step, exc)
        missing = len(requests) - len(rewards) - failed
        return EvalRecord(
            step=step,
            version=version,
            reward_mean=sum(rewards) / max(1, len(requests)),
            samples=len(requests),
            failed=failed + missing,
            seconds=time.monotonic() - started,
            token_versions=sorted(versions),
        )


__all__ = ["EVAL_PRIORITY", "Evaluator"]
