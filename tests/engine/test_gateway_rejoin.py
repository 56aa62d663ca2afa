"""An engine keeps itself listed by SGLang's gateway: the real smg 1.13.0 (which keeps no state) SIGKILLed and
started again on the same port with the same keys lists the engine again, without the engine restarting."""

from __future__ import annotations

import signal
from urllib.parse import urlsplit

from rollq.local import Processes
from tests.gateways import listed, start_smg
from tests.helpers import wait_until

ADMIN = "gateway-admin-key"


async def test_an_engine_rejoins_a_restarted_gateway(engine_process, tmp_path):
    procs = Processes(tmp_path / "gateway-logs")
    (tmp_path / "gateway-logs").mkdir()
    try:
        gateway = await start_smg(procs, admin_api_key=ADMIN, health_interval_s=1)
        args = ["--gateway-url", gateway, "--gateway-admin-api-key", ADMIN, "--gateway-check-interval-s", "0.5"]
        _, engine = await engine_process(*args)  # a synthetic engine
        await wait_until(lambda: has(gateway, engine), 10, what="the engine joined the gateway")

        [(_, smg)] = procs.started()
        smg.send_signal(signal.SIGKILL)
        smg.wait(10)
        port = urlsplit(gateway).port
        assert await start_smg(procs, admin_api_key=ADMIN, health_interval_s=1, port=port) == gateway
        # the engine posts itself again once it sees the new gateway's list without it
        await wait_until(lambda: has(gateway, engine), 10, what="the engine listed again by the restarted gateway")
    finally:
        procs.stop_all(grace_s=5)


async def has(gateway: str, engine: str) -> bool:
    return engine in await listed(gateway, ADMIN)
