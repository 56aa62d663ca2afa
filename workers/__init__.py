"""The worker process: queue loop, workflow runtime (resolver and allowlist, built-in loops), agents and their
recording proxy, tool calls and rewards. `rollq.workers.worker.Worker` is the process's core.

`from rollq.workers import workflow_context` gives AReaL's `workflow_context` (see rollq.workers.context); AReaL's
other workflow names are in rollq.workers.api."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "workflow_context":  # loaded on use: importing rollq.workers alone stays light
        from rollq.workers.context import workflow_context

        return workflow_context
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
