"""The producing side of the staleness bound: offer groups to the ledger and queue the admitted ones."""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from rollq.producer.producer import JobRequest, Producer
from rollq.trainer.data import PromptOrder
from rollq.trainer.ledger import Ride, StalenessLedger, direct

log = logging.getLogger("rollq.trainer")


class GroupFeeder:
    """Keeps the queue as full as the ledger allows. Group i is job `{prefix}{i}` with prompt `prompts[i]`, so a
    restarted feeder re-offers the same groups: the ledger counts each once and the producer queues each once."""

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
        next_index: int = 0,
        recheck_s: float = 1.0,
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
        self.next_index = next_index  # first group not yet admitted
        self.recheck_s = recheck_s  # the ledger may also change elsewhere (another trainer life): look again
        self._room = asyncio.Event()
        self._stopping = False

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

    async def run(self) -> None:
        while not self._stopping:
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
            data = {**self.prompts[self.next_index], "group_id": job_id}
            request = JobRequest(
                workflow=self.workflow,
                data=data,
                n=self.group_size,
                job_id=job_id,
                workflow_kwargs=self.workflow_kwargs,
            )
            # Safe to repeat: SUBMIT's idempotency marker queues a job id once.
            await self.ride(partial(self.producer.submit_many, [request]), "queueing a group")
            self.next_index += 1


__all__ = ["GroupFeeder"]
