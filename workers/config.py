from __future__ import annotations

import msgspec


class WorkerConfig(msgspec.Struct, kw_only=True):
    """Settings of one worker process."""

    redis_url: str
    run: str = "default"
    name: str = ""  # consumer name; "" = host-pid-random
    concurrency: int = 64  # jobs run at once
    engine_urls: list[str] = []
    max_attempts: int = 3  # runs of a job (crashes included) before it is dead-lettered
    lease_idle_ms: int = 60_000  # a pending job idle this long belongs to a dead worker and may be reclaimed
    lease_refresh_ms: int = 0  # how often live jobs' leases are refreshed; 0 = lease_idle_ms / 6
    reclaim_interval_ms: int = 0  # how often dead workers' jobs are looked for; 0 = lease_idle_ms / 4
    heartbeat_ms: int = 2_000
    block_ms: int = 500  # longest blocking read; bounds how fast a stop is noticed
    drain_grace_s: float = 30.0  # on SIGTERM, how long in-flight jobs may take to finish
    publish_batch: int = 256
    tokenizer: str = "tiny"  # the agent proxy's tokenizer + chat template: "tiny" or the engine model's directory
    agent_processes: int = 4  # subproc-mode agents running at once
    proxy_host: str = "127.0.0.1"  # where the agent proxy listens (subproc agents and inline agents reach it here)
    proxy_port: int = 0  # 0: a free port

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not self.lease_refresh_ms:
            self.lease_refresh_ms = max(50, self.lease_idle_ms // 6)
        if not self.reclaim_interval_ms:
            self.reclaim_interval_ms = max(50, self.lease_idle_ms // 4)
        if self.lease_refresh_ms * 2 > self.lease_idle_ms:
            raise ValueError("lease_refresh_ms must be well below lease_idle_ms (at most half)")
