"""`rollq weight-agent`: serve the weight agent until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from rollq.engine.server.weight_agent.config import WeightAgentConfig
from rollq.engine.server.weight_agent.server import build_app
from rollq.engine.server.weight_agent.versions import LocalVersions
from rollq.http_server import start_site
from rollq.shield import shield_secrets

log = logging.getLogger("rollq.weight_agent")


async def _serve(cfg: WeightAgentConfig, versions: LocalVersions) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner, port = await start_site(build_app(versions, cfg.admin_api_key), cfg.host, cfg.port, access_log=None)
    held = f"version {versions.version}" if versions.version else "no version (the first prepare must be a full one)"
    log.info("weight agent serving on http://%s:%d, holding %s in %s", cfg.host, port, held, versions.local_root)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def weight_agent(cfg: WeightAgentConfig) -> int:
    refusal = cfg.refusal()
    if refusal is not None:
        print(f"rollq weight-agent: {refusal}", file=sys.stderr)
        return 2
    shield_secrets()  # its admin key, out of reach of the machine's other processes (rollq/shield.py)
    assert cfg.weights_root and cfg.local_root
    try:
        versions = LocalVersions(cfg.weights_root, cfg.local_root, keep=cfg.keep_versions)
    except (OSError, ValueError) as exc:
        print(f"rollq weight-agent: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(cfg, versions))


__all__ = ["weight_agent"]
