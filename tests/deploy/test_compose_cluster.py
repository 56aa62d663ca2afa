"""compose.yaml's `cluster` profile, run as written where Docker can't: six redis-servers started with the profile's
own node command (only the port and data directory swapped for local ones), joined by the init service's own
script (only the node names resolved to those local addresses), and checked with its own healthcheck."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.deploy.compose import compose_binary, resolved
from tests.redis_server import free_port

pytestmark = pytest.mark.skipif(
    compose_binary() is None or shutil.which("redis-server") is None, reason="docker-compose or redis-server missing"
)


def cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (+10000, the compose file's default) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 < 65536 and not {port, port + 10000} & taken:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            taken |= {port, port + 10000}
            return port


def test_the_cluster_profile_forms_a_cluster_as_written(tmp_path: Path):
    services = resolved("cluster")["services"]
    taken: set[int] = set()
    ports = [cluster_port(taken) for _ in range(6)]
    procs = []
    try:
        for i, port in enumerate(ports, start=1):
            node = services[f"redis-node-{i}"]
            data = tmp_path / f"node{i}"
            data.mkdir()
            argv = [str(port) if a == "6379" else str(data) if a == "/data" else a for a in node["command"]]
            assert argv[0] == "redis-server" and "--cluster-enabled" in argv
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for port in ports:
            deadline = time.monotonic() + 15
            while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout != b"PONG\n":
                assert time.monotonic() < deadline, f"node on {port} did not start"
                time.sleep(0.05)
        init = services["redis-cluster-init"]
        script = init["command"][-1]
        # Local stand-ins for the compose network: each node name resolves to 127.0.0.1:<its port>.
        local = script.replace("$$", "$").replace("redis-cli -h redis-node-1", f"redis-cli -p {ports[0]}")
        local = local.replace("$(getent hosts redis-node-$n | cut -d' ' -f1):6379", "127.0.0.1:$(eval echo \\$PORT_$n)")
        env = {"PATH": "/usr/bin:/bin:/usr/local/bin", **{f"PORT_{i}": str(p) for i, p in enumerate(ports, 1)}}
        out = subprocess.run(["sh", "-c", local], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        health = init["healthcheck"]["test"][1].replace("redis-cli -h redis-node-1", f"redis-cli -p {ports[0]}")
        deadline = time.monotonic() + 30
        while subprocess.run(["sh", "-c", health]).returncode != 0:
            assert time.monotonic() < deadline, "the init service's healthcheck never passed"
            time.sleep(0.2)
        again = subprocess.run(["sh", "-c", local], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "M:" not in again.stdout, "a restarted init service must leave the cluster"
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
