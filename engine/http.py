"""The keep-alive HTTP connection pool a process uses to talk to its engines."""

from __future__ import annotations

import httpx


def shared_http_client(max_connections: int = 1024) -> httpx.AsyncClient:
    """One per process (owned by the EnginePool): connections are reused across requests and engines.
    No read timeout by default: a paused engine legitimately holds /generate open until it resumes."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        timeout=httpx.Timeout(None, connect=5.0),
    )
