"""arq worker settings for the benchmark: `python -m arq bench.arq_settings.WorkerSettings` (cwd = repo root).

Redis comes from $BENCH_ARQ_REDIS, the queue name from $BENCH_ARQ_QUEUE. With BENCH_ARQ_UVLOOP=1 the worker runs on
uvloop, like the rollq worker does.
`LOG_CONFIG` (pass `--custom-log-dict bench.arq_settings.LOG_CONFIG`) keeps arq's per-job INFO lines off.
Jobs and results are msgpack (rollq.workers.rewards.arq_codec), as in rollq's own arq use: never pickle.
"""

from __future__ import annotations

import os
from typing import Any

from arq.connections import RedisSettings

from bench.workflows import FixedTrajectory
from rollq.workers.rewards import arq_codec

if os.environ.get("BENCH_ARQ_UVLOOP") == "1":
    import asyncio

    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.set_event_loop(uvloop.new_event_loop())  # arq calls get_event_loop() before running

_WORKFLOW = FixedTrajectory()


async def fixed_trajectory(ctx: dict[str, Any], data: Any) -> dict[str, Any]:
    """The same 1,024-token trajectory dict the rollq workflow returns."""
    return await _WORKFLOW.arun_episode(None, data)


class WorkerSettings:
    functions = [fixed_trajectory]
    redis_settings = RedisSettings.from_dsn(os.environ.get("BENCH_ARQ_REDIS", "redis://127.0.0.1:6379/1"))
    queue_name = os.environ.get("BENCH_ARQ_QUEUE", "arq:queue")
    max_jobs = 256
    job_serializer = staticmethod(arq_codec.encode)
    job_deserializer = staticmethod(arq_codec.decode)
    # poll_delay: arq's default (0.5 s)


LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"arq.standard": {"level": "WARNING", "class": "logging.StreamHandler", "formatter": "arq.standard"}},
    "formatters": {"arq.standard": {"format": "%(asctime)s: %(message)s", "datefmt": "%H:%M:%S"}},
    "loggers": {"arq": {"handlers": ["arq.standard"], "level": "WARNING"}},
}
