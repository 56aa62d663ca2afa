"""When a run trains nothing: the samples the trainer reads fail, or come back with no generated token, one after
another. A broken engine does both (issue 42): requests its errors abort are failed samples once the workers give up
on them, and a workflow that takes an aborted answer as it is publishes a sample with no generated token, which
trains 0 tokens however many steps the run takes.

The rule: `limit` samples in a row (the trainer uses two steps' worth, 2 x batch_samples) that failed, were
rejected, or hold no token the model generated stop the run with NothingTrains, which `rollq up` and `rollq train`
turn into exit code 4 and a line naming the first error of the streak. One sample with a generated token ends the
streak: a run that trains something each step goes on (its engines' ERROR lines are on `rollq up`'s console).
"""

from __future__ import annotations

from rollq.protocol.messages import Trajectory
from rollq.user_frame import innermost_user_frame


class NothingTrains(RuntimeError):
    """Samples keep failing or coming back empty: a bad workflow, reward function, dataset or engine, not bad luck.
    `worker_id`: the worker that ran the example failure ('' when none failed), whose log holds its traceback."""

    exit_code = 4  # of `rollq up` and `rollq train` (2: a part could not start or died; 3: Redis stayed away)

    def __init__(self, message: str, worker_id: str = "") -> None:
        super().__init__(message)
        self.worker_id = worker_id


class FruitlessStreak:
    """Counts the samples read in a row that trained nothing; `read` raises NothingTrains at `limit` (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0  # samples in the current streak
        self.failed = 0  # of them, failed or rejected (the rest held no generated token)
        self.example = ""  # what the streak's first failed sample said, and where in the user's code
        self.worker_id = ""  # the worker that ran it
        self.productive = False  # a sample with a generated token was read at some point

    def read(self, traj: Trajectory, generated_tokens: int) -> None:
        if traj.status == "ok" and generated_tokens > 0:
            self.count = self.failed = 0
            self.example = self.worker_id = ""
            self.productive = True
            return
        self.count += 1
        if traj.status != "ok":
            self.failed += 1
            if not self.example:
                self.example = describe_error(traj)
                self.worker_id = traj.error.worker_id if traj.error else ""
        if self.limit and self.count >= self.limit:
            raise NothingTrains(self.describe(), self.worker_id)

    def describe(self) -> str:
        which = "last" if self.productive else "first"
        empty = self.count - self.failed
        said = (
            f"the {which} {self.count} samples all failed or generated no token ({self.failed} failed, {empty} with "
            "no generated token): nothing trains"
        )
        return f"{said}; e.g. {self.example}" if self.example else f"{said}; are the engines' requests aborted?"


def describe_error(traj: Trajectory) -> str:
    """`Type: message`, with the innermost frame of the user's code its traceback went through, if any."""
    if traj.error is None:
        return traj.status
    where = innermost_user_frame(traj.error.traceback)
    return f"{traj.error.type}: {traj.error.message}" + (f" (at {where})" if where else "")


__all__ = ["FruitlessStreak", "NothingTrains", "describe_error"]
