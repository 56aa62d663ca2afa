"""The training loop: feed the queue through the staleness ledger, consume groups, train, move every engine to the
new weights, checkpoint.

Per step v -> v + 1:
  collect B samples of complete, fresh groups (a group older than v - eta is dropped as a unit and its admission
  released) -> decoupled PPO step -> write weights -> pause engines, update_weights_from_disk(version v + 1),
  resume (generation restarts here) -> publish v + 1 in the ledger -> checkpoint -> ack the consumed trajectories.
A trainer killed anywhere restarts from its checkpoint: groups it trained are skipped, pending ones redelivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
import torch

from engine.fleet import FleetController
from engine.pool import EnginePool
from producer.producer import JobRequest, Producer
from producer.results import Delivered, ResultConsumer
from trainer.batch import Group, build_batch
from trainer.config import TrainConfig
from trainer.data import PromptStream, load_prompts
from trainer.ledger import StalenessLedger
from trainer.metrics import MetricsLog, plot
from trainer.policy import Policy

log = logging.getLogger("rollq.trainer")

CONSUMER_GROUP = "trainer"
CONSUMER_NAME = "trainer"  # fixed: a restarted trainer first re-reads what its previous life left pending


class TrainerState(msgspec.Struct, kw_only=True):
    """What a checkpoint holds besides the model and optimizer."""

    step: int = 0
    version: int = 0
    next_group: int = 0  # groups submitted so far (job ids g0, g1, ...)
    prompt_position: int = 0
    trained_groups: list[str] = []
    dropped_samples: int = 0
    accepted_samples: int = 0


class Trainer:
    def __init__(self, config: TrainConfig, redis: aioredis.Redis, pool: EnginePool, *,
                 metrics_out: Any = None) -> None:
        self.cfg = config
        self.redis = redis
        self.pool = pool
        self.fleet = FleetController(pool)
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.run_dir, metrics_out)
        self.ledger = StalenessLedger(redis, config.run, config.batch_samples, config.max_staleness)
        self.producer = Producer(redis, config.run)
        self.consumer = ResultConsumer(redis, self.producer.reply_to, group=CONSUMER_GROUP, name=CONSUMER_NAME)
        self.policy = Policy(config)
        self.prompts = PromptStream(load_prompts(config.dataset), seed=config.seed)
        self.state = TrainerState()
        self._pending: dict[str, list[Delivered]] = {}
        self._admission_changed = asyncio.Event()
        self._generated_tokens = 0

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    # -- checkpoint ----------------------------------------------------------------------------------------------------

    def _save_checkpoint(self) -> None:
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save({"policy": self.policy.state(), "state": msgspec.to_builtins(self.state)}, tmp)
        tmp.replace(self.checkpoint_path)

    def _load_checkpoint(self) -> bool:
        if not self.checkpoint_path.exists():
            return False
        saved = torch.load(self.checkpoint_path, map_location=self.cfg.device, weights_only=False)
        self.policy.load_state(saved["policy"])
        self.state = msgspec.convert(saved["state"], TrainerState)
        self.prompts.position = self.state.prompt_position
        return True

    # -- weights -------------------------------------------------------------------------------------------------------

    async def _publish_weights(self, version: int) -> dict[str, float]:
        """Weights of `version` onto every engine; generation resumes as soon as they are loaded."""
        path = await asyncio.to_thread(self.policy.save_weights, self.run_dir / "weights" / f"v{version}")
        phases = await self.fleet.cycle(str(path), version, mode=self.cfg.pause_mode)
        await self.ledger.set_version(version)
        self._admission_changed.set()
        old = self.run_dir / "weights" / f"v{version - 2}"
        if old.exists():  # engines may still be reading v-1 if one is reconciling; older is garbage
            await asyncio.to_thread(__import__("shutil").rmtree, old, True)
        return phases

    # -- feeding -------------------------------------------------------------------------------------------------------

    async def _submit_loop(self) -> None:
        """Admit and submit groups for as long as the ledger has room, forever (cancelled at the end)."""
        prompts = iter(self.prompts)
        data = next(prompts)
        while True:
            job_id = f"g{self.state.next_group}"
            admission = await self.ledger.admit(job_id, self.cfg.group_size)
            if not admission.admitted:
                self._admission_changed.clear()
                try:
                    await asyncio.wait_for(self._admission_changed.wait(), 1.0)
                except TimeoutError:
                    pass
                continue
            await self.producer.submit_many([JobRequest(
                workflow=self.cfg.workflow, data={**data, "group_id": job_id}, n=self.cfg.group_size, job_id=job_id,
                workflow_kwargs=self.cfg.workflow_kwargs)])
            self.state.next_group += 1
            self.state.prompt_position = self.prompts.position
            data = next(prompts)

    # -- consuming -----------------------------------------------------------------------------------------------------

    async def _collect(self) -> tuple[list[Group], list[Delivered], Counter]:
        """Complete, fresh groups for one step; drops stale / failed groups as they complete."""
        cfg = self.cfg
        ready: list[Group] = []
        used: list[Delivered] = []
        staleness: Counter = Counter()
        while len(ready) < cfg.groups_per_step:
            for d in await self.consumer.read(count=256, block_ms=500):
                self._pending.setdefault(d.trajectory.job_id, []).append(d)
            for job_id in [j for j, items in self._pending.items() if len(items) >= cfg.group_size]:
                items = self._pending.pop(job_id)
                group = Group(job_id=job_id, samples=[d.trajectory for d in items])
                if job_id in self.state.trained_groups:  # trained before a crash, not yet acked: ack only
                    await self.consumer.commit(items)
                    continue
                oldest = group.oldest_version
                if not group.ok or oldest < self.state.version - cfg.max_staleness:
                    why = "failed samples" if not group.ok else f"version {oldest} < {self.state.version - cfg.max_staleness}"
                    log.info("dropping group %s (%s)", job_id, why)
                    await self.ledger.release(job_id)
                    self._admission_changed.set()
                    self.state.dropped_samples += len(items)
                    await self.consumer.commit(items)
                    continue
                if len(ready) < cfg.groups_per_step:
                    ready.append(group)
                    used += items
                    staleness[self.state.version - oldest] += len(items)
                else:
                    self._pending[job_id] = items  # complete, but for the next step
        return ready, used, staleness

    # -- the loop ------------------------------------------------------------------------------------------------------

    async def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        await self.pool.start()
        resumed = self._load_checkpoint()
        if resumed:
            await self.ledger.restore_version(self.state.version)
        else:
            await self.ledger.reset()
        await self.consumer.setup()
        await self._publish_weights(self.state.version)  # engines start from the trainer's weights
        log.info("%s at step %d (version %d); %d steps to go", "resumed" if resumed else "starting",
                 self.state.step, self.state.version, cfg.steps - self.state.step)
        submitter = asyncio.create_task(self._submit_loop(), name="submitter")
        try:
            while self.state.step < cfg.steps:
                await self._step()
                if submitter.done():
                    submitter.result()  # surface its failure
        finally:
            submitter.cancel()
            await asyncio.gather(submitter, return_exceptions=True)
        records = self.metrics.read()
        if records:
            plot(records, self.run_dir / "plot.png")
        return records

    async def _step(self) -> None:
        cfg = self.cfg
        started = time.monotonic()
        groups, used, staleness = await self._collect()
        collected = time.monotonic()
        batch = build_batch(groups, self.policy.pad_id)
        stats = await asyncio.to_thread(self.policy.train_step, batch)
        trained = time.monotonic()
        self.state.version += 1
        self.state.step += 1
        phases = await self._publish_weights(self.state.version)
        self.state.trained_groups += [g.job_id for g in groups]
        self.state.accepted_samples += len(used)
        if self.state.step % cfg.checkpoint_every == 0 or self.state.step == cfg.steps:
            await asyncio.to_thread(self._save_checkpoint)
        await self.consumer.commit(used)
        elapsed = time.monotonic() - started
        ledger = await self.ledger.state()
        record = {
            "step": self.state.step, "version": self.state.version,
            "reward_mean": float(batch.rewards.mean()), "reward_max": float(batch.rewards.max()),
            "accepted_samples": self.state.accepted_samples, "dropped_samples": self.state.dropped_samples,
            "staleness_mean": sum(k * n for k, n in staleness.items()) / max(1, sum(staleness.values())),
            "staleness_max": max(staleness) if staleness else 0,
            "staleness_hist": {str(k): n for k, n in sorted(staleness.items())},
            "trained_tokens": batch.tokens, "tokens_per_s": batch.tokens / max(elapsed, 1e-9),
            "collect_s": collected - started, "train_s": trained - collected, "step_s": elapsed,
            "pause_s": phases["total_s"], "weight_load_s": phases["load_s"],
            "ledger_admitted": ledger.admitted, "time": time.time(), **stats,
        }
        self.metrics.write(record)


__all__ = ["Trainer", "TrainerState"]
