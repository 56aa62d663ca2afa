"""A real six-node Redis Cluster (three primaries, three replicas) on free loopback ports, with the faults the chaos
tests inject. Starting, stopping, the topology and the waits for a healthy cluster are rollq.local.RedisCluster's;
this adds failover tricks. Every wait is bounded.

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
import signal
import time
from collections.abc import Iterator
from typing import Any

import redis

from rollq.local import ClusterNode, RedisCluster, WaitTimeout, cluster_nodes, wait_until_sync


class LocalCluster(RedisCluster):
    """rollq.local.RedisCluster plus faults: SIGKILL a node, wait for its failover, restart it, pause replication."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._replicas_before_kill: dict[str, set[str]] = {}
        self._stopped: set[int] = set()  # ports of nodes SIGSTOPped by pause_replication

    def _any_live(self) -> ClusterNode:
        return next(n for n in self.nodes if n.alive and n.port not in self._stopped)

    def close(self) -> None:
        self.resume([n for n in self.nodes if n.port in self._stopped])
        super().close()

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

        def applied(r: ClusterNode) -> bool:
            with r.client() as c:
                return int(c.info("replication").get("slave_repl_offset", -1)) >= target

        deadline = time.monotonic() + timeout_s
        for r in replicas:
            left = max(0.0, deadline - time.monotonic())
            wait_until_sync(lambda r=r: applied(r), left, 0.01, f"replica {r} to reach primary {primary}'s {target}")

    def resume(self, nodes: list[ClusterNode]) -> None:
        """SIGCONT nodes pause_replication() froze."""
        for n in nodes:
            if n.alive:
                assert n.proc is not None
                n.proc.send_signal(signal.SIGCONT)
            self._stopped.discard(n.port)

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL the node's process (no shutdown, no final fsync). Remembers its replicas for wait_failover."""
        with contextlib.suppress(redis.RedisError, StopIteration):
            self._replicas_before_kill[node.node_id] = {r.node_id for r in self.replicas_of(node)}
        node.kill()

    def wait_failover(self, old: ClusterNode, timeout_s: float = 15.0) -> ClusterNode:
        """Bounded wait until a former replica of ``old`` is a primary owning slots, and every surviving node reports
        the cluster ok and agrees. Returns the promoted node."""
        last: list[Exception] = []

        def promoted() -> ClusterNode | None:
            live = [n for n in self.nodes if n.alive and n is not old]
            try:
                rows = cluster_nodes(live[0])
                old_row = next((r for r in rows if r.id == old.node_id), None)
                if (old_row is not None and old_row.slots) or not self.agree(live):
                    return None
                candidates = self._replicas_before_kill.get(old.node_id, set())
                for r in rows:
                    if "master" in r.flags and "fail" not in r.flags and r.slots and r.id in candidates:
                        return next(n for n in live if n.node_id == r.id)
            except (redis.RedisError, ValueError, IndexError) as e:
                last[:] = [e]
            return None

        try:
            return wait_until_sync(promoted, timeout_s, 0.05, f"a failover of {old}")
        except WaitTimeout as e:
            raise WaitTimeout(f"{e} (last error: {last[0] if last else None!r})") from None

    def restart(self, node: ClusterNode, timeout_s: float = 15.0) -> None:
        """Start the node again on the same port and directory (same nodes.conf); once the cluster has failed it over
        it rejoins as a replica. Waits until it is a replica with its link up, and every live node reports ok and
        agrees. (Restarting a primary that was never failed over brings it back as that primary.)"""
        if node.alive:
            raise RuntimeError(f"{node} is still running")
        deadline = time.monotonic() + timeout_s
        node.start()

        def rejoined() -> bool:
            with contextlib.suppress(redis.RedisError):
                with node.client() as c:
                    repl = c.info("replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") == "up":
                    return True
                return repl.get("role") == "master" and node in self.primaries()  # never failed over: same primary
            return False

        wait_until_sync(rejoined, max(0.0, deadline - time.monotonic()), 0.05, f"{node} to rejoin as a synced replica")
        self.wait_ok(max(1.0, deadline - time.monotonic()))


@contextlib.contextmanager
def local_cluster(**kwargs: Any) -> Iterator[LocalCluster]:
    """``with local_cluster() as c:`` or, in a fixture, ``with local_cluster(node_timeout_ms=1000) as c: yield c``."""
    with LocalCluster(**kwargs) as cluster:
        yield cluster
