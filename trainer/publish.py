"""A weight update must reach enough engines, or the trainer stops.

Engines left at an older version feed the trainer samples it can only drop as stale once the policy has moved
`max_staleness` versions past them: a fleet whose updates all fail (an sglang-router as the trainer's engine: it
answers /generate and 404s every control route) would be trained on for a few steps, then every group dropped,
forever, while workers generate into the drop pile. So a pause -> update -> resume cycle that leaves fewer engines
at the new version than required is tried again (the whole cycle: idempotent, and it covers engines that joined
meanwhile), with exponential backoff, and then `WeightUpdateFailed` ends the run, naming each engine that was not
updated with the route, HTTP status and answer of every call it failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from rollq.engine.fleet import CycleReport
from rollq.engine.pool import EnginePool

log = logging.getLogger("rollq.trainer")

ERROR_CHARS = 500  # of one failed call in the error (an engine's message can be a whole traceback)


class WeightUpdateFailed(RuntimeError):
    """A weight update reached fewer engines than required, after every retry: the trainer must stop."""


class UpdateRequirement(msgspec.Struct, frozen=True, kw_only=True):
    """How many engines a weight update must reach and how hard to try (the trainer's `min_engines_updated`,
    `weight_update_retries`, `weight_update_backoff_s`)."""

    min_engines: int = 0  # 0: every engine of the pool that is healthy, and at least one
    retries: int = 3  # cycles tried again after the first falls short
    backoff_s: float = 1.0  # wait before the first retry; doubled before each next one

    def needed(self, pool: EnginePool) -> int:
        """Engines the update must leave at the new version. Read after the cycle: an engine whose control calls
        could not connect was evicted by then (dead: its requests fail over, and it is reloaded when it is back), so
        it does not count; one that answered and refused does."""
        if self.min_engines:
            return self.min_engines
        return max(1, sum(1 for m in pool.engines() if m.healthy))

    def delay_s(self, retry: int) -> float:
        return self.backoff_s * 2**retry


async def publish(
    cycle: Callable[[], Awaitable[CycleReport]], pool: EnginePool, requirement: UpdateRequirement, version: str | int
) -> CycleReport:
    """Run `cycle` until it leaves `requirement.needed(pool)` engines updated and resumed; returns that cycle's
    report. Short of it after `requirement.retries` retries: WeightUpdateFailed."""
    for retry in range(requirement.retries + 1):
        report = await cycle()
        needed = requirement.needed(pool)
        if len(report.updated) >= needed:
            return report
        if retry == requirement.retries:
            break
        delay = requirement.delay_s(retry)
        log.warning(
            "weight update to version %s reached %d of the %d engines it needs; trying again in %g s (retry %d of "
            "%d): %s",
            version,
            len(report.updated),
            needed,
            delay,
            retry + 1,
            requirement.retries,
            "; ".join(_not_updated(report, pool)),
        )
        await asyncio.sleep(delay)
    raise WeightUpdateFailed(shortfall(report, pool, needed, requirement, version))


def shortfall(
    report: CycleReport, pool: EnginePool, needed: int, requirement: UpdateRequirement, version: str | int
) -> str:
    """The error that stops the trainer: how far short the update fell, then every failed call of each engine that
    was not updated (its URL and route, the HTTP status, the answer)."""
    wanted = f"min_engines_updated {requirement.min_engines}"
    if not requirement.min_engines:
        wanted += ": every healthy engine"
    lines = "\n".join(f"  {line}" for line in _not_updated(report, pool))
    return (
        f"weight update to version {version} reached {len(report.updated)} of the {needed} engines it needs "
        f"({wanted}) in {requirement.retries + 1} attempts; stopping rather than training on while engines serve an "
        f"older version. What the engines that were not updated answered:\n{lines}"
    )


def _not_updated(report: CycleReport, pool: EnginePool) -> list[str]:
    """One line per failed call of each engine left behind (and one for an engine the cycle never reached: it joined
    during the update)."""
    updated, failures = set(report.updated), report.failures()
    lines: list[str] = []
    for url in dict.fromkeys([*failures, *(m.url for m in pool.engines())]):
        if url in updated:
            continue
        for error in failures.get(url) or [f"{url}: not part of this update (it joined the pool meanwhile)"]:
            lines.append(error if len(error) <= ERROR_CHARS else error[:ERROR_CHARS] + "...")
    return lines


__all__ = ["UpdateRequirement", "WeightUpdateFailed", "publish", "shortfall"]
