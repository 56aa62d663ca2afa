"""Whether an engine's generations fail with engine errors: what makes /health, /health_generate and /ready answer 503
besides SGLang's own reasons (starting, shutting down, paused or updating past the probe's timeout).

SGLang has no such state: a forward that raises kills its scheduler, which takes the server down with it (0.5.23
managers/scheduler.py:6370-6373, SIGQUIT to the parent), so a client sees a dead engine. rollq's reference engine
aborts the failed batch with an engine-error abort (status_code 500) and goes on serving; this is what keeps such an
engine from answering healthy while every generation fails (issue 42).

The rule: `errors` generations in a row finished with an engine error (an abort with a 5xx status_code, or a backend
that raised), none finishing with a stop or a length in between, and the last of them less than `hold_s` ago. An abort
without an error status (a pause, /abort_request, a client that left, shutdown) is neither a failure nor a success: a
paused engine stays healthy, as SGLang's readiness rule expects. The health probe's own generation counts when it
fails (a 503 at once) but ends no streak when it passes: one prompt token says little of what real requests meet (a
shared-prefix failure spares it). So after `hold_s` with no new engine error the routes answer 200 again while the
probe passes, and the engine takes requests again; the first one that fails puts it back out at once, the first one
that succeeds ends the streak. Each failing period that follows another with no success between holds twice as
long (30, 60, 120 s ... up to 10 minutes), so an engine that keeps failing is out of routing longer and longer,
as a crashed SGLang is until someone restarts it, while one that failed once is back after `hold_s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rollq.engine.types import FinishReason

log = logging.getLogger("rollq.engine")


def is_engine_error(finish: FinishReason | None) -> bool:
    """An abort the engine caused (status_code 5xx); 4xx aborts are the request's fault."""
    if finish is None or finish.type != "abort" or finish.status_code is None:
        return False
    return finish.status_code >= 500


MAX_HOLD_S = 600.0  # the longest a hold grows to (unless the configured one is longer)


class GenerationHealth:
    """The engine-error streak of one engine server (see the module docstring)."""

    def __init__(self, errors: int, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.errors = errors
        self.base_hold_s = hold_s
        self.hold_s = hold_s  # of the current failing period: doubled each time it fails again with no success
        self.clock = clock
        self.streak = 0  # engine errors in a row, none succeeding since
        self.last_error_at = -float("inf")
        self.last_error = ""
        self.trips = 0  # failing periods since the last success
        # The last health probe failed: /ready says unhealthy until one passes, as SGLang's server_status (set
        # UnHealthy by a failed /health_generate, Up by a passing one: 0.5.23 http_server.py:784 and 798; is_ready
        # reads it)
        self.probe_failed = False

    @property
    def failing(self) -> bool:
        return self.errors > 0 and self.streak >= self.errors and self.clock() - self.last_error_at < self.hold_s

    @property
    def ready(self) -> bool:
        return not self.failing and not self.probe_failed

    def probed(self, error: str | None) -> None:
        """A health probe ended: with an engine error (counted like any), or not (it ends no streak: one prompt token
        says little of what real requests meet)."""
        self.probe_failed = error is not None
        if error is not None:
            self.failed(error)

    def finished(self, finish: FinishReason | None) -> None:
        """A generation ended: an engine error adds to the streak, a stop or length finish ends it."""
        if is_engine_error(finish):
            assert finish is not None
            self.failed(finish.message or "engine error")
        elif finish is not None and finish.type in ("stop", "length"):
            if self.trips:
                log.info("a generation succeeded again after %d engine errors: healthy", self.streak)
            self.streak = self.trips = 0
            self.hold_s = self.base_hold_s

    def failed(self, message: str) -> None:
        was_failing = self.failing
        self.streak += 1
        self.last_error_at = self.clock()
        self.last_error = message
        if was_failing or not self.failing:
            return
        if self.trips:  # back from a failing period, failing again before any success: hold it out longer
            self.hold_s = min(self.hold_s * 2, max(MAX_HOLD_S, self.base_hold_s))
        self.trips += 1
        log.error(
            "%d generations in a row failed with engine errors (the last: %s): /health answers 503 until one "
            "succeeds, or for %g s after the last engine error",
            self.streak,
            message,
            self.hold_s,
        )


__all__ = ["GenerationHealth", "is_engine_error"]
