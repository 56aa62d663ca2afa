"""What the trainer writes again when Redis answers after an outage: a restart (with AOF everysec it may have lost its
last second of writes) or a Redis Cluster failover (replication is asynchronous: the replica taking over may lack the
primary's last writes). Each write is repeated only where Redis lost it, so recovery is safe to run at any time,
however often (Trainer.ride runs it before each retry of a call that failed, and once at start)."""

from __future__ import annotations

import logging

from rollq.producer.producer import Producer
from rollq.producer.results import PartitionedConsumer, ResultConsumer
from rollq.trainer.checkpoint import TrainerState
from rollq.trainer.collector import GroupCollector
from rollq.trainer.feeder import GroupFeeder
from rollq.trainer.ledger import StalenessLedger

log = logging.getLogger("rollq.trainer")


async def recover(
    consumer: ResultConsumer | PartitionedConsumer,
    producer: Producer,
    ledger: StalenessLedger,
    *,
    state: TrainerState | None,
    feeder: GroupFeeder | None,
    collector: GroupCollector | None,
) -> None:
    """Re-create what Redis may have lost (the results group, the run's partition count, the ledger) and re-read the
    consumer's pending entries (a read whose reply was lost left some there; so does a commit Redis lost: the
    collector acks those samples without training them, as their groups are settled). `state`: the trainer's, once
    it has resumed (None before: the ledger is not its own yet)."""
    consumer.resync()
    await consumer.setup()
    await producer.remember_partitions()
    if state is None:
        return
    if not await ledger.redis.exists(ledger.keys.ledger):
        await ledger.restore(state.version, state.trained_samples)
        log.warning("the staleness ledger was gone from Redis after an outage; rebuilt from the trainer's state")
    if feeder is not None and collector is not None:
        await repair_ledger(ledger, feeder, collector)


async def repair_ledger(
    ledger: StalenessLedger, feeder: GroupFeeder, collector: GroupCollector, *, fresh: bool = False
) -> tuple[int, int]:
    """Write again the ledger writes Redis may have lost: the admissions of the groups in flight (admitted, not
    trained or dropped yet), the give-backs of recent drops, and the version last published (the version only moves
    forward). Each is a no-op where Redis kept it. Returns (admissions, give-backs) it had to record again.
    `fresh`: Redis is new to this run (`rollq up`'s private one on a resume): writing them all again is expected."""
    readmitted = released = 0
    for job_id in feeder.outstanding:
        readmitted += await ledger.readmit(job_id, feeder.group_size)
    for job_id, reason, rest in list(collector.recent_drops):
        if rest is None:
            released += bool(await ledger.release(job_id, reason))
        else:
            released += bool(await ledger.release_rest(job_id, rest, reason))
    if ledger.published is not None:
        await ledger.set_version(ledger.published)
    if (readmitted or released) and fresh:
        log.info(
            "recorded %d admissions and %d give-backs of the checkpoint's groups in this fresh Redis (as expected)",
            readmitted,
            released,
        )
    elif readmitted or released:
        log.warning(
            "Redis had lost ledger writes: recorded %d admissions and %d give-backs again", readmitted, released
        )
    return readmitted, released


__all__ = ["recover", "repair_ledger"]
