"""Processes on this machine: free loopback ports, bounded waits, supervised children with a log each, a
redis-server (plain or with AOF) and a local Redis Cluster.

One home for what `rollq up`, the benchmarks and the tests all need, so that a fix to "the port was taken between
picking it and binding it" or "a child died while we waited for it" is made once. It imports no other rollq module
(and no test or bench code): anything may use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

import msgspec
import redis

T = TypeVar("T")

HOST = "127.0.0.1"  # everything started here listens on loopback only
SLOTS = 16384  # a Redis Cluster's hash slots


class LocalError(RuntimeError):
    """A local process could not be started, died, or did not become ready in time."""


class ChildExited(LocalError):
    """A supervised child exited; the message names it and ends with its log's tail."""


class WaitTimeout(LocalError, TimeoutError):
    """A bounded wait ran out (also a TimeoutError, as callers that only know asyncio's expect)."""


# -- ports and waits ---------------------------------------------------------------------------------------------


PORT_RANGE_ENV = "ROLLQ_LOCAL_PORTS"
"""`LO-HI`: free_port() hands out this range's ports in turn instead of asking the kernel. For machines that start
many servers at once (the test suite): a range outside the kernel's ephemeral one (/proc/sys/net/ipv4/
ip_local_port_range) is never picked by another program's bind(0) or connect() in the moment between picking a port
and the child binding it, and handing them out in turn never gives one twice until the range wraps."""


def free_port(taken: Collection[int] = ()) -> int:
    """A TCP port on loopback that nothing listens on now, not one of `taken`. Someone else may bind it before the
    caller's child does: starters that pick their own port retry with another when the child exits at once. With
    ROLLQ_LOCAL_PORTS set, the next free port of that range (shared by every process of this user)."""
    if spec := os.environ.get(PORT_RANGE_ENV):
        return _next_port_in_range(spec, taken)
    for _ in range(100):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port: int = s.getsockname()[1]
        if port not in taken:
            return port
    raise LocalError("no free port")


def _port_range(spec: str) -> tuple[int, int]:
    low, sep, high = spec.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo = hi = 0
    if not sep or not 1024 <= lo < hi <= 65535:
        raise LocalError(f"{PORT_RANGE_ENV}={spec!r}: expected LO-HI, two ports from 1024 to 65535, LO below HI")
    return lo, hi


def port_is_free(port: int) -> bool:
    """Whether a TCP socket can bind `port` on loopback now."""
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _next_port_in_range(spec: str, taken: Collection[int]) -> int:
    """The range's next port that is bindable now and not in `taken`. Where the range stands is kept in a file of this
    user's (under an exclusive lock), so that concurrent processes, test workers and their children alike, take
    turns rather than picking the same port."""
    lo, hi = _port_range(spec)
    size = hi - lo + 1
    counter = Path(tempfile.gettempdir()) / f"rollq-ports-{os.getuid()}-{lo}-{hi}"
    fd = os.open(counter, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_uid != os.getuid():
            raise LocalError(f"{counter} belongs to another user: {PORT_RANGE_ENV} needs a counter of its own")
        fcntl.flock(fd, fcntl.LOCK_EX)
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        turn = int(text) if text.isdigit() else 0
        for _ in range(size):
            port = lo + turn % size
            turn += 1
            if port not in taken and port_is_free(port):
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(turn % size).encode(), 0)
                return port
    finally:
        os.close(fd)  # releases the lock
    raise LocalError(f"no free port in {PORT_RANGE_ENV}={spec}")


def _timed_out(what: str, timeout_s: float, where: str = "") -> WaitTimeout:
    return WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}" + (f" ({where})" if where else ""))


async def wait_until(
    predicate: Callable[[], Any], timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"
) -> Any:
    """Poll `predicate` (sync, or returning an awaitable) until it returns something true, and return that. For
    another process's progress, which has no event to await; WaitTimeout past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout_s)
        await asyncio.sleep(interval_s)


def wait_until_sync(
    predicate: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"
) -> T:
    """wait_until() for code without an event loop (a fixture, a thread): blocks between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout_s)
        time.sleep(interval_s)


# -- supervised children -----------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child, before exec: Linux sends it SIGTERM when the parent dies without stopping it (SIGKILL). The
    "parent" is the thread that forked it (prctl(2)): a child started from a thread that ends before the process
    (an executor's, at its shutdown) gets SIGTERM then, so Processes starts such children from the main thread only."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


class Processes:
    """Child processes, each with stdout and stderr in `log_dir/NAME.log` (a restart under the same name appends),
    stopped together by stop_all(). check() and wait_until() turn a child that died into ChildExited with the end
    of its log, rather than a silent stall."""

    def __init__(
        self,
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        """`env`: variables every child gets on top of this process's environment. `die_with_parent` (Linux): the
        children get SIGTERM if this process is SIGKILLed (a preexec hook: only where no other thread forks); they
        are started from the main thread only (_die_with_parent says why)."""
        self.log_dir = log_dir
        self.env = dict(env or {})
        self.cwd = cwd
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self._children: list[_Child] = []
        self._stopped: set[int] = set()  # pids stopped on purpose: not an error for check()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        pass_fds: Sequence[int] = (),
    ) -> subprocess.Popen[bytes]:
        """Start `argv` with this process's environment plus the common `env` plus this `env` (never secrets in
        argv, which every local user can read; `rollq up` hands them over in a pipe among `pass_fds`,
        rollq/handover.py). In a session of its own: a terminal's Ctrl-C reaches only us, and we stop the children
        in order."""
        if self.die_with_parent and threading.current_thread() is not threading.main_thread():
            raise LocalError(f"{name}: a child that dies with its parent is started from the main thread only")
        log = self.log_dir / f"{name}.log"
        mode = "ab" if any(c.name == name for c in self._children) else "wb"
        with open(log, mode) as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, **(env or {})},
                cwd=cwd or self.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
                pass_fds=tuple(pass_fds),
            )
        self._children.append(_Child(name, proc, log))
        return proc

    def started(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        """Every child started so far with its name, oldest first (a child started again under a name: both)."""
        return [(c.name, c.proc) for c in self._children]

    def logs(self) -> dict[str, Path]:
        """Each child's log by its name (a child started again under a name appends to the same log)."""
        return {c.name: c.log for c in self._children}

    def _child(self, proc: subprocess.Popen[bytes]) -> _Child:
        return next(c for c in self._children if c.proc is proc)

    def tail(self, proc: subprocess.Popen[bytes], chars: int = 3000) -> str:
        """The end of the child's log."""
        try:
            return self._child(proc).log.read_bytes()[-chars:].decode(errors="replace")
        except (OSError, StopIteration):
            return ""

    def check(self, proc: subprocess.Popen[bytes] | None = None) -> None:
        """ChildExited if `proc` (default: any child not stopped on purpose) has exited."""
        for child in self._children if proc is None else [self._child(proc)]:
            if child.proc.poll() is not None and child.proc.pid not in self._stopped:
                raise ChildExited(
                    f"{child.name} exited with code {child.proc.returncode}; the end of its log:\n"
                    f"{self.tail(child.proc, 2000)}"
                )

    async def wait_until(
        self,
        predicate: Callable[[], Any],
        timeout_s: float,
        what: str,
        *,
        watch: subprocess.Popen[bytes] | None = None,
        interval_s: float = 0.05,
    ) -> Any:
        """The module's wait_until(), ended early by ChildExited when `watch` (default: any child) dies."""

        async def probe() -> Any:
            self.check(watch)
            value = predicate()
            return await value if isinstance(value, Awaitable) else value

        try:
            return await wait_until(probe, timeout_s, interval_s, what)
        except WaitTimeout:
            raise _timed_out(what, timeout_s, f"logs in {self.log_dir}") from None

    def reap(self, proc: subprocess.Popen[bytes]) -> int | None:
        """`proc`'s exit code once it has exited, None while it runs; an exited child no longer fails check() (its
        supervisor decides what its exit means)."""
        code = proc.poll()
        if code is not None:
            self._stopped.add(proc.pid)
        return code

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL (no shutdown: what a crash looks like) and reap."""
        self._stopped.add(proc.pid)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)

    def stop(self, proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
        """SIGTERM (and SIGCONT, for a child that was SIGSTOPped), SIGKILL past `grace_s`."""
        self.stop_all(grace_s, [proc])

    def stop_all(self, grace_s: float = 10.0, procs: Sequence[subprocess.Popen[bytes]] | None = None) -> None:
        """Stop every child (newest first, all within one grace period) and reap them."""
        targets = [c.proc for c in reversed(self._children)] if procs is None else list(procs)
        for proc in targets:
            self._stopped.add(proc.pid)
            if proc.poll() is None and grace_s > 0:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                    proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        for proc in targets:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


# -- redis-server ------------------------------------------------------------------------------------------------


class RedisArgs(msgspec.Struct, frozen=True, kw_only=True):
    """A redis-server command line: loopback only, no RDB snapshots, the append-only file off or fsynced as asked;
    with a `cluster_port` a cluster node (its config file in `directory`)."""

    port: int
    directory: str
    aof: bool = False
    appendfsync: Literal["always", "everysec"] = "always"
    cluster_port: int | None = None
    node_timeout_ms: int = 1000
    extra: tuple[str, ...] = ()
    config_file: str | None = None  # read first (redis-server's rule): what must not be on its command line

    def argv(self, exe: str) -> list[str]:
        args = [exe, *([self.config_file] if self.config_file else [])]
        args += ["--port", str(self.port), "--bind", HOST, "--dir", self.directory, "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", self.appendfsync] if self.aof else ["--appendonly", "no"]
        if self.cluster_port is not None:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-port", str(self.cluster_port),
                "--cluster-config-file", str(Path(self.directory) / "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--repl-diskless-sync-delay", "0",  # replicas sync at once (default: wait 5 s for more replicas)
            ]  # fmt: skip
        return [*args, *self.extra]


def redis_binary(name: str = "redis-server") -> str:
    exe = shutil.which(name)
    if exe is None:
        raise LocalError(f"{name} is not installed (apt-get install -y redis-server, or see CONTRIBUTING.md)")
    return exe


def redis_pings(port: int, password: str | None = None) -> bool:
    """Whether a Redis on loopback `port` answers PING (stdlib only: no client, no pool, for tight polls). A server
    still loading its AOF answers -LOADING: not yet. With `password`: AUTH first (a wrong one: False)."""
    try:
        with socket.create_connection((HOST, port), timeout=0.2) as s:
            if password is not None:
                s.sendall(f"AUTH {password}\r\n".encode())
                if not _reply_line(s).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return _reply_line(s).startswith(b"+PONG")
    except OSError:
        return False


def _reply_line(s: socket.socket, limit: int = 256) -> bytes:
    """One reply line (a simple reply or an error), read until CRLF within the socket's timeout."""
    data = b""
    while not data.endswith(b"\r\n") and len(data) < limit:
        chunk = s.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data


class RedisServer:
    """One redis-server on a loopback port, in `directory` (default: a temporary one, deleted by close()).
    kill() + start() is a crash and a restart on the same port and directory (from the AOF with `aof=True`)."""

    def __init__(
        self,
        *,
        port: int | None = None,
        directory: str | Path | None = None,
        aof: bool = False,
        appendfsync: Literal["always", "everysec"] = "always",
        processes: Processes | None = None,
        name: str = "redis",
        extra_args: Sequence[str] = (),
        password: str | None = None,
    ) -> None:
        """`processes`: the supervisor to start it under (its log there, stopped with the others); by default one of
        its own with the log in `directory`. A `port` given is kept; one picked here is picked again when taken.
        `password`: every client must AUTH (`requirepass`, in a config file of mode 0600 in `directory`, not on
        the command line every local user can read); `url` carries it."""
        self._own_dir = directory is None
        self.dir = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="rollq-redis-"))
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.password = password
        if password is not None:
            self._check_password(password)
        config_file = None if password is None else str(self.dir / "redis-auth.conf")
        self.args = RedisArgs(
            port=self.port,
            directory=str(self.dir),
            aof=aof,
            appendfsync=appendfsync,
            extra=tuple(extra_args),
            config_file=config_file,
        )
        self.processes = processes or Processes(self.dir)
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def _check_password(password: str) -> None:
        if not password or any(c.isspace() or c in "\"'\\" for c in password):
            raise ValueError("a redis-server password must be non-empty, without spaces, quotes or backslashes")

    def _write_config(self) -> None:
        """The password's config file (mode 0600), for one start: removed once the server has read it (it answers, or
        it exited), so that it is not left for processes of the same user to read."""
        if self.password is None or self.args.config_file is None:
            return
        fd = os.open(self.args.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {self.password}\n")

    def _remove_config(self) -> None:
        if self.args.config_file is not None:
            Path(self.args.config_file).unlink(missing_ok=True)

    @property
    def url(self) -> str:
        auth = "" if self.password is None else f":{self.password}@"
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _argv(self) -> list[str]:
        return self.args.argv(redis_binary())

    def _ready(self) -> bool:
        return redis_pings(self.port, self.password)

    def _settled(self, proc: subprocess.Popen[bytes]) -> bool:
        """It answers, or it exited (start() tells which)."""
        return proc.poll() is not None or self._ready()

    def start(self, timeout_s: float = 10.0) -> Self:
        """Start it and wait until it answers. LocalError with its log if it exits, WaitTimeout past `timeout_s`."""
        attempts = 1 if self._fixed_port else 3
        while True:
            self.args = msgspec.structs.replace(self.args, port=self.port)
            self._write_config()
            try:
                proc = self.processes.start(self.name, self._argv())
                self.proc = proc
                try:
                    wait_until_sync(
                        partial(self._settled, proc), timeout_s, 0.02, f"{self.name} on {self.port} to answer"
                    )
                except WaitTimeout:
                    self.processes.kill(proc)
                    raise
            finally:
                self._remove_config()
            if proc.poll() is None:
                return self
            attempts -= 1
            if not attempts:
                raise LocalError(
                    f"{self.name} on port {self.port} exited with {proc.returncode}:\n{self.processes.tail(proc)}"
                )
            self.port = free_port()  # most likely taken since it was picked: another one

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync (what `--appendfsync always` already wrote survives)."""
        if self.proc is not None:
            self.processes.kill(self.proc)
        self.proc = None

    def stop(self, grace_s: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM): with AOF on, everything acknowledged so far is on disk."""
        if self.proc is not None:
            self.processes.stop(self.proc, grace_s)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a local Redis Cluster ---------------------------------------------------------------------------------------


class ClusterNode(RedisServer):
    """One `redis-server --cluster-enabled yes`: a RedisServer with a bus port and, once started, its node id."""

    def __init__(self, *, port: int, bus_port: int, directory: Path, node_timeout_ms: int, aof: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        super().__init__(port=port, directory=directory, aof=aof, name="redis")
        self.args = msgspec.structs.replace(self.args, cluster_port=bus_port, node_timeout_ms=node_timeout_ms)
        self.node_id = ""

    def repick_ports(self, port: int, bus_port: int) -> None:
        """New ports before a start (the old ones were taken by someone else meanwhile)."""
        self.port = port
        self.args = msgspec.structs.replace(self.args, port=port, cluster_port=bus_port)

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def client(self, timeout_s: float = 1.0) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _ready(self) -> bool:
        if not redis_pings(self.port):
            return False
        try:
            with self.client() as c:
                self.node_id = c.execute_command("CLUSTER MYID").decode()
        except redis.RedisError:
            return False
        return True

    def __repr__(self) -> str:
        return f"ClusterNode({self.addr}, id={self.node_id[:8]}, alive={self.alive})"


class NodeRow(msgspec.Struct, frozen=True):
    """One line of CLUSTER NODES."""

    id: str
    port: int
    flags: frozenset[str]
    master: str
    slots: tuple[tuple[int, int], ...]
    connected: bool


def cluster_info(node: ClusterNode) -> dict[str, str]:
    """CLUSTER INFO as a dict of strings (redis-py parses it already; raw text is handled too)."""
    with node.client() as c:
        raw = c.execute_command("CLUSTER INFO")
    if isinstance(raw, dict):
        return {str(k): v.decode() if isinstance(v, bytes) else str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.strip().splitlines() if ":" in line)


def cluster_nodes(node: ClusterNode) -> list[NodeRow]:
    """CLUSTER NODES as `node` sees them."""
    with node.client() as c:
        raw = c.execute_command("CLUSTER NODES")
    if isinstance(raw, dict):  # redis-py's parse_cluster_nodes: {"host:port": {...}}
        return [
            NodeRow(
                id=info["node_id"],
                port=int(addr.split("@")[0].rsplit(":", 1)[1]),
                flags=frozenset(info["flags"].split(",")),
                master=info["master_id"],
                slots=tuple((int(s[0]), int(s[-1])) for s in info["slots"]),
                connected=bool(info["connected"]),
            )
            for addr, info in raw.items()
        ]
    rows = []
    for line in (raw.decode() if isinstance(raw, bytes) else str(raw)).strip().splitlines():
        parts = line.split()
        slots = []
        for s in parts[8:]:
            if s.startswith("["):  # a migrating/importing marker
                continue
            lo, _, hi = s.partition("-")
            slots.append((int(lo), int(hi or lo)))
        rows.append(
            NodeRow(
                id=parts[0],
                port=int(parts[1].split("@")[0].rsplit(":", 1)[1]),
                flags=frozenset(parts[2].split(",")),
                master=parts[3],
                slots=tuple(slots),
                connected=parts[7] == "connected",
            )
        )
    return rows


class RedisCluster:
    """`primaries * (1 + replicas)` cluster nodes on loopback joined by `redis-cli --cluster create`. Control
    traffic uses redis-py's sync client; every wait is bounded."""

    def __init__(
        self,
        *,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        aof: bool = False,
        directory: str | Path | None = None,
    ) -> None:
        self.replicas = replicas
        self._own_dir = directory is None
        self.dir = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="rollq-redis-cluster-"))
        self._taken: set[int] = set()
        self.nodes = [
            ClusterNode(
                port=self._free_port(),
                bus_port=self._free_port(),
                directory=self.dir / f"node{i}",
                node_timeout_ms=node_timeout_ms,
                aof=aof,
            )
            for i in range(primaries * (1 + replicas))
        ]

    def _free_port(self) -> int:
        """free_port(), never the same port twice to this cluster (client port or bus port)."""
        port = free_port(self._taken)
        self._taken.add(port)
        return port

    @property
    def url(self) -> str:
        """A redis:// URL of one live node (the first), good as a cluster client's startup node."""
        return next(n.url for n in self.nodes if n.alive)

    def node_by_port(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def start(self, timeout_s: float = 30.0) -> Self:
        try:
            for node in self.nodes:
                for attempt in range(3):  # a port taken by someone else between free_port() and bind: pick again
                    try:
                        node.start()
                        break
                    except LocalError:
                        if attempt == 2:
                            raise
                        node.repick_ports(self._free_port(), self._free_port())
            cmd = [redis_binary("redis-cli"), "--cluster", "create", *(n.addr for n in self.nodes)]
            cmd += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            if out.returncode != 0:
                raise LocalError(f"redis-cli --cluster create failed: {out.stdout}\n{out.stderr}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def agree(self, live: list[ClusterNode]) -> bool:
        """Every live node says ok and sees all slots served, every live replica's link to its primary is up, and all
        agree on the topology (who is down, who serves which slots, who replicates whom)."""
        views = []
        for n in live:
            info = cluster_info(n)
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_assigned", 0)) != SLOTS:
                return False
            if int(info.get("cluster_slots_ok", 0)) != SLOTS:
                return False
            with n.client() as c:
                repl = c.info("replication")
            if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                return False  # a replica that never synced cannot be promoted: wait until it has
            view: dict[str, object] = {}
            for row in cluster_nodes(n):
                if "fail" in row.flags or "fail?" in row.flags:
                    view[row.id] = "down"
                elif "master" in row.flags:
                    view[row.id] = ("primary", tuple(sorted(row.slots)))
                else:
                    view[row.id] = ("replica", row.master)
            views.append(view)
        return all(v == views[0] for v in views)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok, all slots covered, and every node agrees."""
        last: list[Exception] = []

        def ok() -> bool:
            live = [n for n in self.nodes if n.alive]
            try:
                return bool(live) and self.agree(live)
            except (redis.RedisError, ValueError) as e:
                last[:] = [e]
                return False

        try:
            wait_until_sync(ok, timeout_s, 0.05, "the cluster to be ok")
        except WaitTimeout as e:
            raise WaitTimeout(f"{e} (last error: {last[0] if last else None!r})") from None

    def _any_live(self) -> ClusterNode:
        return next(n for n in self.nodes if n.alive)

    def keyslot(self, key: str | bytes) -> int:
        with self._any_live().client() as c:
            return int(c.execute_command("CLUSTER KEYSLOT", key))

    def primary_for(self, key: str | bytes) -> ClusterNode:
        """The node that currently serves `key`'s slot, as seen by a live node (CLUSTER KEYSLOT + CLUSTER SLOTS)."""
        slot = self.keyslot(key)
        with self._any_live().client() as c:
            ranges = c.execute_command("CLUSTER SLOTS")
        for r in ranges:
            # redis-py parses CLUSTER SLOTS into {(lo, hi): {"primary": (host, port), ...}} or leaves the raw list
            if isinstance(ranges, dict):
                (lo, hi), port = r, int(ranges[r]["primary"][1])
            else:
                lo, hi, port = int(r[0]), int(r[1]), int(r[2][1])
            if lo <= slot <= hi:
                return self.node_by_port(port)
        raise LookupError(f"no node serves slot {slot}")

    def primaries(self) -> list[ClusterNode]:
        rows = cluster_nodes(self._any_live())
        ports = {r.port for r in rows if "master" in r.flags and "fail" not in r.flags and r.slots}
        return [n for n in self.nodes if n.port in ports]

    def replicas_of(self, node: ClusterNode) -> list[ClusterNode]:
        rows = cluster_nodes(self._any_live())
        ports = {r.port for r in rows if r.master == node.node_id}
        return [n for n in self.nodes if n.port in ports]

    def close(self) -> None:
        """SIGKILL every node (a test cluster keeps nothing) and delete the directory if it is ours."""
        for n in self.nodes:
            n.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "HOST",
    "ChildExited",
    "ClusterNode",
    "LocalError",
    "NodeRow",
    "Processes",
    "RedisArgs",
    "RedisCluster",
    "RedisServer",
    "WaitTimeout",
    "cluster_info",
    "cluster_nodes",
    "free_port",
    "port_is_free",
    "redis_binary",
    "redis_pings",
    "wait_until",
    "wait_until_sync",
]
