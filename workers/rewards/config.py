"""`rollq reward-worker`'s settings: the `reward_worker` section, ROLLQ_REWARD_WORKER_<KEY>, and the command's flags."""

from __future__ import annotations

from typing import Annotated

from rollq.config import RunSettings, setting
from rollq.module_paths import SETTING_DOC as MODULE_PATHS_DOC


class RewardWorkerConfig(RunSettings, kw_only=True):
    """A reward worker: runs a run's remote reward calls (workflows with reward_mode=remote) in killable children."""

    max_workers: Annotated[
        int, setting("child processes per reward function, so rewards run at once", metavar="N", ge=1)
    ] = 2
    timeout: Annotated[
        float, setting("seconds one reward call may run before its process is killed", metavar="S", gt=0)
    ] = 15.0
    # A job taken but waiting for a child would spend its caller's timeout, while one left in Redis can go to
    # another reward worker: hence max_workers by default.
    max_jobs: Annotated[
        int, setting("reward jobs taken from the queue at once (0 = max_workers)", metavar="N", ge=0)
    ] = 0
    metrics_port: Annotated[
        int, setting("serve Prometheus /metrics on this port (0 = off)", metavar="PORT", ge=0, le=65535)
    ] = 0
    metrics_host: Annotated[
        str, setting("address the /metrics server binds (0.0.0.0 in a container so Prometheus can scrape it)")
    ] = "127.0.0.1"
    allow: Annotated[
        list[str],
        setting(
            "import paths of reward functions calls may name besides rollq's built-ins "
            "(repeatable; shell patterns over dotted names)",
            metavar="PATTERN",
        ),
    ] = []
    module_paths: Annotated[list[str], setting(MODULE_PATHS_DOC, flag="--module-path", metavar="DIR")] = []


__all__ = ["RewardWorkerConfig"]
