"""Whom a pool trusts behind a gateway: the real `smg` 1.13.0 on loopback. A pool holding engine keys sends them to
every engine a gateway lists, so it follows only a gateway whose list nobody but its admin-key holders may change:
not one open to anyone (no --control-plane-api-keys), not one that takes the engines' api key (smg --api-key alone
lets every holder of that key, every generation caller, add a URL), and not one that became open at the same URL
after the pool first trusted it. A refused gateway gets no request of the pool's at all."""

from __future__ import annotations

import sys

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.local import Processes, free_port
from tests.gateways import smg_env, start_smg
from tests.helpers import answers

ENGINE_KEY = "engines-api-key"
ADMIN = "gateway-admin-key"
LAUNCH = "import sys; from smg.launch_router import launch_router as run, parse_router_args as p; run(p(sys.argv[1:]))"


async def start_open_smg(procs: Processes, port: int, *flags: str) -> str:
    """smg with no control-plane key (its /workers routes open to whoever its other flags let in) on `port`."""
    argv = [sys.executable, "-c", LAUNCH, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", "manual", *flags]
    proc = procs.start(f"open-smg-{port}", argv, env=smg_env())
    url = f"http://127.0.0.1:{port}"
    await procs.wait_until(lambda: answers(url + "/liveness"), 60, "smg up", watch=proc, interval_s=0.05)
    return url


@pytest.mark.slow
async def test_a_gateway_whose_list_others_may_change_is_refused_at_once_or_when_it_becomes_so(tmp_path):
    procs = Processes(tmp_path)
    try:
        gateway = await start_smg(procs, admin_api_key=ADMIN, api_key=ENGINE_KEY)
        port = int(gateway.rsplit(":", 1)[1])
        async with EnginePool(PoolConfig(urls=[gateway], api_key=ENGINE_KEY, gateway_admin_api_key=ADMIN)) as pool:
            assert pool.members[gateway].kind == "gateway"  # closed: its list takes its admin key only
            procs.stop_all(grace_s=0)
            # At the same URL now: smg with --api-key alone, whose list every holder of the engines' api key may change
            assert await start_open_smg(procs, port, "--api-key", ENGINE_KEY) == gateway
            assert not await answers(gateway + "/workers")  # closed to anyone...
            assert await answers(gateway + "/workers", {"Authorization": f"Bearer {ENGINE_KEY}"})  # ...not to them
            await pool.check_health()
            assert pool.members[gateway].kind == "refused"
            assert pool.engines() == [] and not pool.members[gateway].routable
        # Met first as it is now, with or without that key given as its admin key: refused at once.
        for keys in ({}, {"gateway_admin_api_key": ENGINE_KEY}):
            async with EnginePool(PoolConfig(urls=[gateway], api_key=ENGINE_KEY, **keys)) as pool:
                assert pool.members[gateway].kind == "refused", keys
                assert pool.engines() == [] and not pool.members[gateway].routable
    finally:
        procs.stop_all(grace_s=0)
