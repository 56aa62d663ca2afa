"""The producing side of the staleness bound: offer groups to the ledger and queue the admitted ones."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Any

from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.messages import AgentOptions
from rollq.trainer.data import PromptOrder
from rollq.trainer.ledger import Ride, StalenessLedger, direct

log = logging.getLogger("rollq.trainer")


class GroupFeeder:
    """Keeps the queue as full as the ledger allows. Group i is job `{prefix}{i}` with prompt `prompts[i]`, so a
    restarted feeder re-offers the same groups: the ledger counts each once and the producer queues each once.

    With `reoffer_after_s`, a group admitted that long ago and not settled yet (trained or dropped: `settled()`)
    is looked for in Redis: when its submission's idempotency marker is gone, Redis lost the submission (a restart
    with AOF everysec, a Cluster failover before the replica had it; the marker and the job's entries are written
    in one script, so they vanish together) and the group is queued again under the same id."""

    def __init__(
        self,
        producer: Producer,
        ledger: StalenessLedger,
        prompts: PromptOrder,
        *,
        prefix: str,
        group_size: int,
        workflow: str,
        workflow_kwargs: dict[str, Any] | None,
        agent: AgentOptions | None = None,
        next_index: int = 0,
        recheck_s: float = 1.0,
        reoffer_after_s: float = 0.0,
        priority_by_age: bool = False,
        adapter_family: str = "",
        ride: Ride | None = None,
    ) -> None:
        self.ride: Ride = ride or direct
        self.producer = producer
        self.ledger = ledger
        self.prompts = prompts
        self.prefix = prefix
        self.group_size = group_size
        self.workflow = workflow
        self.workflow_kwargs = workflow_kwargs
        self.agent = agent  # an agent workflow's options (TrainConfig.agent_options)
        self.next_index = next_index  # first group not yet admitted
        self.recheck_s = recheck_s  # the ledger may also change elsewhere (another trainer life): look again
        self.reoffer_after_s = reoffer_after_s  # 0: never look for vanished submissions
        self.priority_by_age = priority_by_age  # group i's engine requests get priority -i: older groups first
        # A LoRA run serving versioned adapters: a group admitted at version v names adapter `<family>-v<v>` (the
        # base model at 0), which the trainer loaded on the engines before the ledger moved to v.
        self.adapter_family = adapter_family
        self.reoffered = 0  # groups queued again because Redis lost their submission
        self._outstanding: dict[str, float] = {}  # admitted, not settled: job id -> when it was (last) queued
        self._admitted_version: dict[str, int] = {}  # admitted by this feeder, not settled: job id -> ledger version
        # job id -> the ledger version it was admitted at, for groups settled since the trainer last took them
        self.settled_versions: dict[str, int] = {}
        self._next_look = 0.0
        self._room = asyncio.Event()
        self._stopping = False

    def settled(self, job_id: str) -> None:
        """The group was handed out to train or dropped: nothing more is expected of it."""
        self._outstanding.pop(job_id, None)
        version = self._admitted_version.pop(job_id, None)
        if version is not None:
            self.settled_versions[job_id] = version

    @property
    def outstanding(self) -> list[str]:
        """Groups admitted and not settled yet."""
        return list(self._outstanding)

    def watch(self, indices: list[int]) -> None:
        """Groups admitted earlier (before a restart) and not settled: look for them too."""
        now = time.monotonic()
        for index in indices:
            self._outstanding.setdefault(self.job_id(index), now)

    def notify(self) -> None:
        """The ledger has room again (a new version was published or a group was given back)."""
        self._room.set()

    def stop(self) -> None:
        """Finish at the next turn. (Cancelling alone is not enough: redis-py's retry can swallow a cancellation
        that lands inside a command.)"""
        self._stopping = True
        self._room.set()

    def job_id(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def request(self, index: int, version: int = 0) -> JobRequest:
        job_id = self.job_id(index)
        return JobRequest(
            lora=adapter_name(self.adapter_family, version) if self.adapter_family and version > 0 else "",
            workflow=self.workflow,
            data={**self.prompts[index], "group_id": job_id},
            n=self.group_size,
            job_id=job_id,
            workflow_kwargs=self.workflow_kwargs,
            agent=self.agent,
            priority=-index if self.priority_by_age else None,
        )

    async def reoffer_vanished(self) -> list[str]:
        """Queue again the groups outstanding for `reoffer_after_s` whose submission Redis lost; returns them."""
        now = time.monotonic()
        if not self.reoffer_after_s or now < self._next_look:
            return []
        self._next_look = now + min(self.reoffer_after_s, 10.0)
        due = [job_id for job_id, since in self._outstanding.items() if now - since >= self.reoffer_after_s]
        if not due:
            return []
        gone = await self.ride(partial(self.producer.vanished, due), "looking for vanished groups")
        for job_id in gone:
            index = int(job_id[len(self.prefix) :])
            version = self._admitted_version.get(job_id, 0)
            await self.ride(
                partial(self.producer.submit_many, [self.request(index, version)]), "queueing a group again"
            )
            self._outstanding[job_id] = time.monotonic()
            self.reoffered += 1
            log.warning("group %s vanished from Redis (its submission was lost); queued it again", job_id)
        return gone

    async def run(self) -> None:
        while not self._stopping:
            await self.reoffer_vanished()
            job_id = self.job_id(self.next_index)
            self._room.clear()
            admission = await self.ride(partial(self.ledger.admit, job_id, self.group_size), "admitting a group")
            if not admission.admitted:
                try:
                    async with asyncio.timeout(self.recheck_s):
                        await self._room.wait()
                except TimeoutError:
                    pass
                continue
            # Outstanding from its admission on: should Redis lose that admission while the group is being queued (a
            # failover under the SUBMIT below), the trainer's recovery records it again (trainer/recovery.py).
            self._outstanding.setdefault(job_id, time.monotonic())
            self._admitted_version.setdefault(job_id, admission.version)
            # Safe to repeat: SUBMIT's idempotency marker queues a job id once.
            version = self._admitted_version[job_id]
            request = self.request(self.next_index, version)
            await self.ride(partial(self.producer.submit_many, [request]), "queueing a group")
            if job_id in self._outstanding:  # (not settled meanwhile: results of an earlier life's submission)
                self._outstanding[job_id] = time.monotonic()  # queued now: reoffer_after_s counts from here
            self.next_index += 1


def adapter_name(family: str, version: int) -> str:
    """The engines' name of a LoRA run's adapter of `version` (no ':' in it: SGLang's OpenAI routes split
    `model` there; the pool reads the version back from its trailing number)."""
    return f"{family}-v{version}"


__all__ = ["GroupFeeder", "adapter_name"]
