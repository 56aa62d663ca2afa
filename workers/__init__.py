"""The worker process: queue loop, workflow runtime (agent proxy, tool loop and rewards come with later issues)."""

from workers.config import WorkerConfig
from workers.worker import Worker, WorkerStats

__all__ = ["Worker", "WorkerConfig", "WorkerStats"]
