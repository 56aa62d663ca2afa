"""The worker process: queue loop, workflow runtime (resolver and allowlist, built-in loops), agents and their
recording proxy, tool calls and rewards. `rollq.workers.worker.Worker` is the process's core."""
