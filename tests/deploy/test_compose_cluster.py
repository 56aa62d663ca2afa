"""compose.yaml's `cluster` profile, run as written where Docker can't: six redis-servers started with the profile's
own node command (its users and replication login included; only the port and data directory swapped for local
ones), joined by the init service's own script with its environment (only the node names resolved to those local
addresses), and checked with its own healthchecks."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis as sync_redis
from redis.exceptions import NoPermissionError

from rollq.local import Processes, free_port, port_is_free, wait_until
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.redis_client import redis_client
from tests.deploy.compose import compose_binary, interpolation_env, resolved

pytestmark = pytest.mark.skipif(
    compose_binary() is None or shutil.which("redis-server") is None, reason="docker-compose or redis-server missing"
)


def cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (+10000, the compose file's default) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 < 65536 and not {port, port + 10000} & taken and port_is_free(port + 10000):
            taken |= {port, port + 10000}
            return port


def node_ready(health: str, env: dict[str, str]) -> bool:
    return subprocess.run(["sh", "-c", health], env=env, capture_output=True).returncode == 0


async def test_the_cluster_profile_forms_a_cluster_as_written(tmp_path: Path, compose_secrets):
    """Six nodes with the profile's users (`default` off), formed by the init service's script as `cluster-admin`,
    replicas syncing as `replication`; a rollq role user then works on the cluster within its run's keys only."""
    run = f"cl{uuid.uuid4().hex[:6]}"
    services = resolved("cluster", secrets=compose_secrets, env=interpolation_env(ROLLQ_RUN=run))["services"]
    taken: set[int] = set()
    ports = [cluster_port(taken) for _ in range(6)]
    base_env = {"PATH": "/usr/bin:/bin:/usr/local/bin"}
    with Processes(tmp_path) as procs:
        for i, port in enumerate(ports, start=1):
            node = services[f"redis-node-{i}"]
            data = tmp_path / f"node{i}"
            data.mkdir()
            argv = [str(port) if a == "6379" else str(data) if a == "/data" else a for a in node["command"]]
            assert argv[0] == "redis-server" and "--cluster-enabled" in argv
            procs.start(f"redis-node-{i}", [*argv, "--bind", "127.0.0.1"])
        for i, port in enumerate(ports, start=1):
            node = services[f"redis-node-{i}"]
            health = node["healthcheck"]["test"][1].replace("-p 6379", f"-p {port}")
            env = {**base_env, **node["environment"]}
            # the node's own healthcheck, as its user
            await procs.wait_until(lambda h=health, e=env: node_ready(h, e), 15, f"the node on {port}")
        init = services["redis-cluster-init"]
        script = init["command"][-1]
        # Local stand-ins for the compose network: each node name resolves to 127.0.0.1:<its port>.
        local = script.replace("$$", "$").replace("-h redis-node-1", f"-p {ports[0]}")
        local = local.replace("$(getent hosts redis-node-$n | cut -d' ' -f1):6379", "127.0.0.1:$(eval echo \\$PORT_$n)")
        env = {**base_env, **init["environment"], **{f"PORT_{i}": str(p) for i, p in enumerate(ports, 1)}}
        out = subprocess.run(["sh", "-c", local], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        health = init["healthcheck"]["test"][1].replace("-h redis-node-1", f"-p {ports[0]}")
        passed = "the init service's healthcheck to pass"
        await procs.wait_until(lambda: node_ready(health, env), 30, passed, interval_s=0.2)
        again = subprocess.run(["sh", "-c", local], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "M:" not in again.stdout, "a restarted init service must leave the cluster"
        await check_replication_and_roles(ports, run, compose_secrets.values)


async def check_replication_and_roles(ports: list[int], run: str, secrets: dict[str, str]) -> None:
    """Every replica's link to its primary is up (it logged in as `replication`), and a rollq worker user reaches
    its run's keys through redis-py's cluster client, but not another run's."""
    admin = secrets["ROLLQ_REDIS_CLUSTER_ADMIN_PASSWORD"]

    def synced(node: sync_redis.Redis) -> bool:
        info = node.info("replication")
        return info["role"] == "master" or info.get("master_link_status") == "up"

    deadline = time.monotonic() + 30
    for port in ports:
        with sync_redis.Redis(port=port, username="cluster-admin", password=admin) as node:
            left = max(0.0, deadline - time.monotonic())
            await wait_until(lambda n=node: synced(n), left, 0.1, f"the replica on {port} to sync")
    url = f"redis://worker:{secrets['ROLLQ_REDIS_WORKER_PASSWORD']}@127.0.0.1:{ports[0]}/0?cluster=yes"
    worker = redis_client(url, retries=0)
    try:
        keys = RunKeys(run)
        await worker.xadd(keys.jobs, {PAYLOAD_FIELD: b"x"})
        assert await worker.xlen(keys.jobs) == 1
        with pytest.raises(NoPermissionError):
            await worker.xadd(RunKeys(f"{run}-other").jobs, {PAYLOAD_FIELD: b"x"})
    finally:
        await worker.aclose()
