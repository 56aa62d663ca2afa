"""Held-out evaluation during a run: every prompt of `eval_dataset` once, as an evaluation job (`is_eval`, the
workflow's kwargs with `eval_workflow_kwargs` over them, and `eval_temperature` for a workflow that takes one) run
by the workers like any other job, its result read back from a private reply stream. Engine requests carry a high
priority, so an evaluation is served before the training backlog; the trainer waits for it at a step boundary, so
every token is of the version evaluated.

The mean is over the prompts whose sample came back ok. Failed ones (an error, a rejection, no answer in time) are
counted and the first error is kept, so an evaluation whose jobs all failed reads "n/a (10 of 10 failed: ...)", never
as a score of 0."""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from rollq.producer.producer import JobRequest, Producer
from rollq.producer.results import PartitionedConsumer, ResultConsumer
from rollq.protocol.keys import RunKeys
from rollq.protocol.messages import AgentOptions, Trajectory
from rollq.trainer.data import run_prompts
from rollq.trainer.metrics import EvalRecord

if TYPE_CHECKING:
    from rollq.trainer.config import TrainConfig

log = logging.getLogger("rollq.trainer")

EVAL_PRIORITY = 1 << 20  # engines schedule larger first: ahead of every training request
REPLY_TTL_S = 3600  # the reply stream outlives a killed trainer by this much, then expires
ERROR_CHARS = 500  # of the first failure's message, kept in eval.jsonl and printed


class Evaluator:
    def __init__(
        self,
        redis: aioredis.Redis,
        run: str,
        *,
        prompts: list[dict[str, Any]],
        workflow: str,
        workflow_kwargs: dict[str, Any],
        optional_kwargs: dict[str, Any] | None = None,
        agent: AgentOptions | None = None,
        partitions: int = 0,
        timeout_s: float = 600.0,
    ) -> None:
        self.prompts = prompts
        self.workflow = workflow
        self.workflow_kwargs = workflow_kwargs
        self.optional_kwargs = optional_kwargs or None
        self.agent = agent
        self.timeout_s = timeout_s
        name = f"eval-{uuid.uuid4().hex[:12]}"
        self.producer = Producer(
            redis, run, reply_to=RunKeys(run).reply_stream(name), reply_ttl_s=REPLY_TTL_S, partitions=partitions
        )
        self._consumer: ResultConsumer | PartitionedConsumer | None = None

    @classmethod
    def for_run(cls, redis: aioredis.Redis, cfg: TrainConfig, prompts: list[dict[str, Any]] | None = None) -> Evaluator:
        """The evaluator of a run's settings: eval_dataset (mapped and checked as the dataset; `prompts`: loaded
        so already), the workflow and agent options of its training jobs, eval_workflow_kwargs and eval_temperature
        over them."""
        kwargs, optional = cfg.eval_job_kwargs()
        if prompts is None:
            prompts = run_prompts(cfg)[1]
        return cls(
            redis,
            cfg.run,
            prompts=prompts,
            workflow=cfg.workflow,
            workflow_kwargs=kwargs,
            optional_kwargs=optional,
            agent=cfg.agent_options(),
            partitions=cfg.partitions,
        )

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
                optional_kwargs=self.optional_kwargs,
                agent=self.agent,
                is_eval=True,
                priority=EVAL_PRIORITY,
                lora=lora,
            )
            for i, record in enumerate(self.prompts)
        ]
        results = await self.producer.submit_many(requests)
        rewards: list[float] = []
        failed = 0
        first_error = ""
        versions: set[int] = set()
        try:
            expected = {r.job_id: 1 for r in results}
            async for traj in self.producer.wait_for(expected, timeout_s=self.timeout_s, consumer=self._consumer):
                if traj.status == "ok":
                    rewards.append(sum(s.reward for s in traj.sequences) / max(1, len(traj.sequences)))
                    versions.update(int(v) for s in traj.sequences for v in s.versions if v >= 0)
                else:
                    failed += 1
                    first_error = first_error or failure(traj)
        except TimeoutError as exc:
            log.warning("evaluation after step %d incomplete: %s", step, exc)
            first_error = first_error or f"no result within {self.timeout_s:g}s"
        missing = len(requests) - len(rewards) - failed
        return EvalRecord(
            step=step,
            version=version,
            reward_mean=sum(rewards) / len(rewards) if rewards else None,
            samples=len(requests),
            failed=failed + missing,
            first_error=first_error,
            seconds=time.monotonic() - started,
            token_versions=sorted(versions),
        )


def failure(traj: Trajectory) -> str:
    """What went wrong with one evaluation sample, in a line: its error's type and message (no traceback)."""
    if traj.error is None:
        return traj.status
    message = traj.error.message.strip().splitlines()[0] if traj.error.message.strip() else ""
    text = f"{traj.error.type}: {message}" if message else traj.error.type
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


__all__ = ["EVAL_PRIORITY", "Evaluator", "failure"]
