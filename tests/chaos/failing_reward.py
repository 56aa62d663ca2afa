"""The chaos soak's reward with injected failures (`python -m tests.chaos.soak --fail-rate P`).

`failing_digits_reward` is the toy task's reward, except that it raises for a fixed fraction of the samples: those
whose (job id, sample index) hashes below `fail_rate` (a data key of the soak's prompts). The choice depends on
nothing else, so a failing sample fails on every attempt: the worker retries it, dead-letters it after
`max_attempts` and publishes an `error` trajectory, which the trainer counts as `failed`. The soak computes the same
set with `fails()` to check that none of them was trained.

Workers import it by path (`tests.chaos.failing_reward:failing_digits_reward`): the soak starts them with
`--allow tests.chaos.failing_reward`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from rollq.tasks.digits import digits_reward
from rollq.workers.context import workflow_context


class InjectedFailure(RuntimeError):
    """The failure the soak injects (not a bug)."""


def fails(job_id: str, sample_index: int, fail_rate: float) -> bool:
    """Whether sample `sample_index` of job `job_id` is one of the failing ones (deterministic, ~fail_rate of all)."""
    if fail_rate <= 0:
        return False
    digest = hashlib.blake2b(f"{job_id}#{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fail_rate


def failing_digits_reward(
    prompt_text: str,
    completion_text: str,
    input_ids: Any = None,
    output_ids: Any = None,
    *,
    fail_rate: float = 0.0,
    **data: Any,
) -> float:
    """digits_reward, or InjectedFailure for the samples `fails()` picks (the running episode's job and index)."""
    episode = workflow_context.get()
    if episode.task_id is not None and fails(episode.task_id, episode.sample_index, fail_rate):
        raise InjectedFailure(
            f"injected failure of sample {episode.task_id}#{episode.sample_index} (fail_rate {fail_rate})"
        )
    return digits_reward(prompt_text, completion_text, input_ids, output_ids, **data)


__all__ = ["InjectedFailure", "fails", "failing_digits_reward"]
