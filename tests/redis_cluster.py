"""A real six-node Redis Cluster (three primaries, three replicas) on free loopback ports, for tests.

Control traffic uses only the stdlib and redis-py's sync client; every wait is bounded.

    with LocalCluster() as cluster:
        node = cluster.primary_for("{a}")
        cluster.kill(node)
        cluster.wait_failover(node)
        cluster.restart(node)  # rejoins as a replica of the promoted node

    A primary's last writes, lost by the failover (replication is asynchronous), deterministically:

        replicas = cluster.pause_replication(node)  # what `node` acknowledges from here on reaches no replica
        ...writes...
        cluster.kill(node)
        cluster.resume(replicas)
        cluster.wait_failover(node)  # the promoted replica lacks those writes
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.redis_server import free_port

SLOTS = 16384


@dataclass
class ClusterNode:
    port: int
    bus_port: int
    dir: Path
    proc: subprocess.Popen | None = None
    node_id: str = ""
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.dir / "redis.log"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, timeout_s: float = 1.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def __repr__(self) -> str:
        return f"ClusterNode({self.addr}, id={self.node_id[:8]}, alive={self.alive})"


def _cluster_info(node: ClusterNode) -> dict[str, str]:
    """CLUSTER INFO as a dict of strings (redis-py parses it already; raw text is handled too)."""
    with node.client() as c:
        raw = c.execute_command("CLUSTER INFO")
    if isinstance(raw, dict):
        return {str(k): v.decode() if isinstance(v, bytes) else str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.strip().splitlines() if ":" in line)


def _cluster_nodes(node: ClusterNode) -> list[dict]:
    """CLUSTER NODES as rows: id, port, flags (set), master id, slots (list of (lo, hi)), connected."""
    with node.client() as c:
        raw = c.execute_command("CLUSTER NODES")
    rows = []
    if isinstance(raw, dict):  # redis-py's parse_cluster_nodes: {"host:port": {...}}
        for addr, info in raw.items():
            rows.append(
                {
                    "id": info["node_id"],
                    "port": int(addr.split("@")[0].rsplit(":", 1)[1]),
                    "flags": set(info["flags"].split(",")),
                    "master": info["master_id"],
                    "slots": [(int(s[0]), int(s[-1])) for s in info["slots"]],
                    "connected": bool(info["connected"]),
                }
            )
        return rows
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    for line in text.strip().splitlines():
        parts = line.split()
        slots = []
        for s in parts[8:]:
            if s.startswith("["):  # a migrating/importing marker
                continue
            lo, _, hi = s.partition("-")
            slots.append((int(lo), int(hi or lo)))
        rows.append(
            {
                "id": parts[0],
                "port": int(parts[1].split("@")[0].rsplit(":", 1)[1]),
                "flags": set(parts[2].split(",")),
                "master": parts[3],
                "slots": slots,
                "connected": parts[7] == "connected",
            }
        )
    return rows


class LocalCluster:
    """Six ``redis-server --cluster-enabled yes`` processes joined by ``redis-cli --cluster create``."""

    def __init__(
        self,
        *,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        aof: bool = False,
        directory: str | None = None,
    ) -> None:
        self.node_timeout_ms = node_timeout_ms
        self.aof = aof
        self.replicas = replicas
        self._own_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="rollq-redis-cluster-"))
        self.nodes: list[ClusterNode] = []
        self._replicas_before_kill: dict[str, set[str]] = {}
        self._stopped: set[int] = set()  # ports of nodes SIGSTOPped by pause_replication
        self._taken: set[int] = set()
        for i in range(primaries * (1 + replicas)):
            d = self.dir / f"node{i}"
            d.mkdir(parents=True, exist_ok=True)
            self.nodes.append(ClusterNode(port=self._free_port(), bus_port=self._free_port(), dir=d))

    def _free_port(self) -> int:
        """free_port(), never handing out the same port twice to this cluster (client port or bus port)."""
        for _ in range(100):
            port = free_port()
            if port not in self._taken:
                self._taken.add(port)
                return port
        raise RuntimeError("no free port")

    # ---- addresses ---------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """A redis:// URL of one live node (the first), good as a cluster client's startup node."""
        return next(n.url for n in self.nodes if n.alive)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def node_by_port(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    def _spawn(self, node: ClusterNode, timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        args = [
            exe,
            "--port", str(node.port),
            "--cluster-port", str(node.bus_port),
            "--bind", "127.0.0.1",
            "--dir", str(node.dir),
            "--save", "",
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(node.dir / "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--logfile", str(node.log),
            "--repl-diskless-sync-delay", "0",  # replicas sync at once (default: wait 5 s for more replicas)
        ]  # fmt: skip
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]
        node.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                tail = node.log.read_text(errors="replace")[-500:] if node.log.exists() else ""
                raise RuntimeError(f"redis-server on {node.addr} exited with {node.proc.returncode}: {tail}")
            try:
                with node.client(0.2) as c:
                    if c.ping():
                        node.node_id = c.execute_command("CLUSTER MYID").decode()
                        return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on {node.addr} did not answer PING in time")

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        try:
            for n in self.nodes:
                for attempt in range(3):  # a port taken by someone else between free_port() and bind: pick again
                    try:
                        self._spawn(n)
                        break
                    except RuntimeError:
                        if attempt == 2:
                            raise
                        n.port, n.bus_port = self._free_port(), self._free_port()
            cli = shutil.which("redis-cli")
            if cli is None:
                raise RuntimeError("redis-cli is not installed")
            cmd = [cli, "--cluster", "create", *(n.addr for n in self.nodes)]
            cmd += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}\n{out.stderr}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _consistent(self, live: list[ClusterNode]) -> bool:
        """Every live node says ok and sees all slots served, every live replica's link to its primary is up, and all
        agree on the topology (who is down, who serves which slots, who replicates whom)."""
        views = []
        for n in live:
            info = _cluster_info(n)
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_assigned", 0)) != SLOTS:
                return False
            if int(info.get("cluster_slots_ok", 0)) != SLOTS:
                return False
            with n.client() as c:
                repl = c.info("replication")
            if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                return False  # a replica that never synced cannot be promoted: wait until it has
            view = {}
            for row in _cluster_nodes(n):
                if "fail" in row["flags"] or "fail?" in row["flags"]:
                    view[row["id"]] = "down"
                elif "master" in row["flags"]:
                    view[row["id"]] = ("primary", tuple(sorted(row["slots"])))
                else:
                    view[row["id"]] = ("replica", row["master"])
            views.append(view)
        return all(v == views[0] for v in views)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Bounded wait until every live node reports cluster_state:ok, all slots covered, and every node agrees."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.alive]
            try:
                if live and self._consistent(live):
                    return
            except (redis.RedisError, ValueError) as e:
                last = e
            time.sleep(0.05)
        raise TimeoutError(f"cluster not ok within {timeout_s}s (last error: {last!r})")

    def close(self) -> None:
        self.resume([n for n in self.nodes if n.port in self._stopped])
        for n in self.nodes:
            if n.proc and n.proc.poll() is None:
                n.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    n.proc.wait(5)
            n.proc = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- topology ----------------------------------------------------------------------------------------------

    def _any_live(self) -> ClusterNode:
        return next(n for n in self.nodes if n.alive and n.port not in self._stopped)

    def keyslot(self, key: str | bytes) -> int:
        with self._any_live().client() as c:
            return int(c.execute_command("CLUSTER KEYSLOT", key))

    def primary_for(self, key: str | bytes) -> ClusterNode:
        """The node that currently serves ``key``'s slot, as seen by a live node (CLUSTER KEYSLOT + CLUSTER SLOTS)."""
        slot = self.keyslot(key)
        with self._any_live().client() as c:
            ranges = c.execute_command("CLUSTER SLOTS")
        for r in ranges:
            # redis-py parses CLUSTER SLOTS into {(lo, hi): {"primary": (host, port), ...}} or leaves the raw list
            if isinstance(ranges, dict):
                (lo, hi), info = r, ranges[r]
                port = int(info["primary"][1])
            else:
                lo, hi, primary = int(r[0]), int(r[1]), r[2]
                port = int(primary[1])
            if lo <= slot <= hi:
                return self.node_by_port(port)
        raise LookupError(f"no node serves slot {slot}")

    def primaries(self) -> list[ClusterNode]:
        rows = _cluster_nodes(self._any_live())
        ports = {r["port"] for r in rows if "master" in r["flags"] and "fail" not in r["flags"] and r["slots"]}
        return [n for n in self.nodes if n.port in ports]

    def replicas_of(self, node: ClusterNode) -> list[ClusterNode]:
        rows = _cluster_nodes(self._any_live())
        ports = {r["port"] for r in rows if r["master"] == node.node_id}
        return [n for n in self.nodes if n.port in ports]

    # ---- faults ------------------------------------------------------------------------------------------------

    def pause_replication(self, primary: ClusterNode) -> list[ClusterNode]:
        """Freeze `primary`'s replicas (SIGSTOP) and close their replication links, so that the writes `primary`
        acknowledges from now on reach no replica: the last writes a failover loses, on purpose. Returns the
        replicas, for resume(). Keep the pause short (well under the node timeout)."""
        replicas = self.replicas_of(primary)
        self.wait_replicated(primary, replicas)
        for r in replicas:
            assert r.proc is not None
            r.proc.send_signal(signal.SIGSTOP)
            self._stopped.add(r.port)
        with primary.client() as c:
            c.execute_command("CLIENT", "KILL", "TYPE", "replica")  # what they applied before stays theirs
        return replicas

    def wait_replicated(self, primary: ClusterNode, replicas: list[ClusterNode], timeout_s: float = 10.0) -> None:
        """Bounded wait until every replica has applied all that ``primary`` had written when called. A replica that
        has just synced gets nothing streamed until the primary reads its first REPLCONF ACK (up to a second later,
        more on a busy machine), so without this wait "the writes before the pause" could still sit in the primary's
        buffer and be lost with it."""
        with primary.client() as c:
            target = int(c.info("replication")["master_repl_offset"])
        deadline = time.monotonic() + timeout_s
        for r in replicas:
            while True:
                with r.client() as c:
                    applied = int(c.info("replication").get("slave_repl_offset", -1))
                if applied >= target:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {r} at offset {applied}, primary {primary} at {target}")
                time.sleep(0.01)

    def resume(self, nodes: list[ClusterNode]) -> None:
        """SIGCONT nodes pause_replication() froze."""
        for n in nodes:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGCONT)
            self._stopped.discard(n.port)

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL the node's process (no shutdown, no final fsync). Remembers its replicas for wait_failover."""
        with contextlib.suppress(redis.RedisError, StopIteration):
            self._replicas_before_kill[node.node_id] = {r.node_id for r in self.replicas_of(node)}
        if node.proc and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(5)

    def wait_failover(self, old: ClusterNode, timeout_s: float = 15.0) -> ClusterNode:
        """Bounded wait until a former replica of ``old`` is a primary owning slots, and every surviving node reports
        the cluster ok and agrees. Returns the promoted node."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.alive and n is not old]
            try:
                rows = _cluster_nodes(live[0])
                promoted = [
                    r
                    for r in rows
                    if "master" in r["flags"] and "fail" not in r["flags"] and r["slots"] and r["id"] != old.node_id
                ]
                old_row = next((r for r in rows if r["id"] == old.node_id), None)
                old_gone = old_row is None or not old_row["slots"]
                if old_gone and self._consistent(live):
                    candidates = self._replicas_before_kill.get(old.node_id, set())
                    for r in promoted:
                        if r["id"] in candidates:
                            return next(n for n in live if n.node_id == r["id"])
            except (redis.RedisError, ValueError, IndexError) as e:
                last = e
            time.sleep(0.05)
        raise TimeoutError(f"no failover of {old} within {timeout_s}s (last error: {last!r})")

    def restart(self, node: ClusterNode, timeout_s: float = 15.0) -> None:
        """Start the node again on the same port and directory (same nodes.conf); once the cluster has failed it over
        it rejoins as a replica. Waits until it is a replica with its link up, and every live node reports ok and
        agrees. (Restarting a primary that was never failed over brings it back as that primary.)"""
        if node.alive:
            raise RuntimeError(f"{node} is still running")
        self._spawn(node)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                with node.client() as c:
                    repl = c.info("replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") == "up":
                    break
                if repl.get("role") == "master" and node in self.primaries():
                    break  # it was never failed over: back as the same primary
            time.sleep(0.05)
        else:
            raise TimeoutError(f"{node} did not rejoin as a synced replica within {timeout_s}s")
        self.wait_ok(max(1.0, deadline - time.monotonic()))


@contextlib.contextmanager
def local_cluster(**kwargs: object) -> Iterator[LocalCluster]:
    """``with local_cluster() as c:`` or, in a fixture, ``with local_cluster(node_timeout_ms=1000) as c: yield c``."""
    cluster = LocalCluster(**kwargs).start()  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.close()
