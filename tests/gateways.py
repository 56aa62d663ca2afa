"""SGLang's gateway as the registry ships it, on loopback, for the tests of rollq behind it: `smg` 1.13.0 (started by
rollq's own launcher, rollq/gateway_process.py, as `rollq up` starts it) and `sglang-router` 0.3.2 (its
`launch_router`). Each runs from a cached site folder of its pinned wheels (tests/third_party.py) put on its
PYTHONPATH only: nothing of them is imported into the tests' own process."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx

from rollq.gateway_process import GatewayFlags
from rollq.handover import HandedConfig
from rollq.local import Processes, free_port
from tests.helpers import answers
from tests.third_party import site

SMG = ["smg==1.13.0", "setproctitle==1.3.8"]  # what `smg launch` imports (grpcio and the rest serve `smg serve`)
# sglang-router's launcher imports its Python load balancer too (fastapi), though the Rust router serves
SGLANG_ROUTER = ["sglang-router==0.3.2", "setproctitle==1.3.8", "fastapi==0.121.0", "starlette==0.49.3"]


def smg_env() -> dict[str, str]:
    """The environment a process needs to run smg from the cached site (`python -c ...` or `smg_python()`)."""
    return {"PYTHONPATH": str(site("smg", SMG))}


async def start_smg(
    procs: Processes, *, admin_api_key: str, api_key: str | None = None, port: int | None = None, **flags: int
) -> str:
    """smg on loopback as `rollq up` runs it (GatewayFlags: manual policy, /model_info health checks), its keys handed
    in a pipe, on `port` (default: a free one); returns its URL once it answers."""
    gateway = GatewayFlags(port=port or free_port(), prometheus_port=free_port(), **flags)
    with HandedConfig({"admin_api_key": admin_api_key, "api_key": api_key}) as handed:
        argv = gateway.argv(sys.executable, handed.argv()[1])
        proc = procs.start(f"smg-{gateway.port}", argv, env=smg_env(), pass_fds=[handed.fd])
    await procs.wait_until(lambda: answers(gateway.url + "/liveness"), 60, "smg up", watch=proc, interval_s=0.05)
    return gateway.url


async def start_sglang_router(procs: Processes, workers: list[str], **flags: str) -> tuple[subprocess.Popen, str]:
    """sglang-router 0.3.2 on loopback (both its ports), round robin, in front of `workers`."""
    port = free_port()
    argv = [
        *[sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)],
        *["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
        *["--policy", "round_robin", "--log-level", "warn", "--worker-urls", *workers],
        *[a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", v)],
    ]
    env = {"PYTHONPATH": str(site("sglang-router", SGLANG_ROUTER))}
    proc = procs.start(f"sglang-router-{port}", argv, env=env)
    url = f"http://127.0.0.1:{port}"
    await procs.wait_until(lambda: answers(url + "/liveness"), 60, "sglang-router up", watch=proc, interval_s=0.05)
    return proc, url


async def listed(gateway: str, admin_api_key: str | None = None) -> dict[str, dict[str, Any]]:
    """The gateway's workers by URL (its own `GET /workers`)."""
    headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        reply = await client.get(gateway + "/workers", headers=headers)
    reply.raise_for_status()
    return {w["url"].rstrip("/"): w for w in reply.json()["workers"]}


async def engine_metric(engine: str, name: str) -> int:
    """One of `engine`'s own Prometheus figures (SGLang's names: sglang:num_requests_total, sglang:num_running_reqs)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        text = (await client.get(engine + "/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(f"{engine}/metrics has no {name}:\n{text[:1000]}")


async def requests_served(engine: str) -> int:
    """How many /generate requests `engine` has served."""
    return await engine_metric(engine, "sglang:num_requests_total")


async def requests_running(engine: str) -> int:
    return await engine_metric(engine, "sglang:num_running_reqs")


async def weight_version(engine: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        return str((await client.get(engine + "/model_info", headers=headers)).json()["weight_version"])
