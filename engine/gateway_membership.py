"""An engine keeps itself listed by its gateway: smg keeps no state, so a restarted gateway lists no engine (and
answers 404 "No worker available") until each one joins again, and behind a Service with several gateway replicas a
single join reaches only the replica the Service picked. So an engine given a gateway checks `GET /workers` every
few seconds and posts itself again (`POST /workers`) when its URL is missing, like the Redis registry's renewals
(engine/registry.py). Each check opens a new connection (the caller's session has no keep-alive), so a Service
picks a replica anew every time and each replica in turn sees the engine missing and gets it back."""

from __future__ import annotations

import asyncio
import logging

from rollq.engine.gateway import GatewayClient, GatewayError

log = logging.getLogger("rollq.engine")


async def keep_listed(client: GatewayClient, url: str, *, api_key: str | None, interval_s: float) -> None:
    """Every `interval_s` until cancelled: when the gateway's list lacks `url`, register it again (with `api_key`, what
    the gateway sends the engine). An unreachable or refusing gateway is logged once per outage, and tried again."""
    url = url.rstrip("/")
    outage = False  # the gateway did not answer or refused, last time
    missing = False  # the gateway did not list this engine, last time
    while True:
        await asyncio.sleep(interval_s)
        try:
            workers = await client.workers()
            if workers is None:
                raise GatewayError(f"{client.url}/workers: not a gateway's worker list")
            listed = url in {w.url for w in workers}
            if not listed:
                worker_id = await client.register(url, api_key=api_key)
                if not missing:  # a gateway that drops the engine again at once (a failing health check) is said once
                    log.warning(
                        "gateway %s did not list %s (restarted?): joined it again (worker %s)",
                        client.url,
                        url,
                        worker_id,
                    )
            missing = not listed
        except GatewayError as exc:
            if not outage:
                log.warning(
                    "cannot check this engine's listing on gateway %s (trying every %gs): %s",
                    client.url,
                    interval_s,
                    exc,
                )
            outage = True
            continue
        if outage:
            log.info("gateway %s answers again", client.url)
            outage = False


__all__ = ["keep_listed"]
