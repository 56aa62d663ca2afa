"""Ranks 1..N-1 of the trainer: wait for rank 0's next command and run the same collective (trainer/policy.py),
until rank 0 says stop. They never touch Redis or the engines."""

from __future__ import annotations

import logging
from pathlib import Path

from rollq.trainer import rank_commands as rc
from rollq.trainer.policy import Policy

log = logging.getLogger("rollq.trainer")


def follow(policy: Policy) -> int:
    """Obey rank 0 until it stops the run; returns the number of steps trained."""
    steps = 0
    while True:
        command = rc.decode(policy.ranks.receive())
        match command:
            case rc.TrainStep(shards=shards, minibatches=minibatches):
                policy.run_step(shards[policy.ranks.rank], minibatches)
                steps += 1
            case rc.WriteWeights(directory=directory):
                policy.write_weights(Path(directory))
            case rc.GatherWeights(bucket_bytes=bucket_bytes):
                for _ in policy.parameter_buckets(bucket_bytes):
                    pass
            case rc.SaveCheckpoint(directory=directory):
                policy.save_checkpoint(Path(directory))
            case rc.LoadCheckpoint(directory=directory):
                policy.load_checkpoint(Path(directory))
            case rc.Stop():
                log.info("rank %d: stopped by rank 0 after %d steps", policy.ranks.rank, steps)
                return steps


__all__ = ["follow"]
