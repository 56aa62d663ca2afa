"""A real redis-server with TLS only (CA-signed server certificate, client certificates required) and the role users
of deploy/redis-acl.conf, for the security tests."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollq.local import Processes, free_port, redis_binary, wait_until_sync
from tests.helpers import REPO_ROOT

ROLES = ("worker", "producer", "trainer", "engine", "rewards")


@dataclass
class TlsRedis:
    port: int
    run: str
    ca: Path
    cert: Path
    key: Path
    passwords: dict[str, str]

    def url(self, user: str, password: str | None = None) -> str:
        return f"rediss://{user}:{password or self.passwords[user]}@127.0.0.1:{self.port}/0"

    def tls(self) -> dict[str, str]:
        return {"redis_tls_ca": str(self.ca), "redis_tls_cert": str(self.cert), "redis_tls_key": str(self.key)}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_certs(d: Path) -> None:
    """ca.{crt,key}; server.{crt,key} for 127.0.0.1 / localhost; client.{crt,key}: all signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=rollq-test-ca", "-keyout",
             "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=rollq-{name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", "san.ext", "-out", f"{name}.crt", cwd=d)  # fmt: skip


def _tls_ping(port: int, d: Path) -> bool:
    ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
    ctx.load_cert_chain(str(d / "client.crt"), str(d / "client.key"))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"-NOAUTH", b"+PONG"))
    except OSError:
        return False


@pytest.fixture(scope="session")
def tls_redis(tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl")
    d = tmp_path_factory.mktemp("tls-redis")
    make_certs(d)
    run = f"sec{uuid.uuid4().hex[:8]}"
    passwords = {role: f"pw-{role}-{uuid.uuid4().hex[:8]}" for role in ROLES}
    acl = (REPO_ROOT / "deploy" / "redis-acl.conf").read_text().replace("{RUN", "{" + run)
    for role, password in passwords.items():
        acl = acl.replace(f">CHANGE-ME-{role}", f">{password}")
    acl += f"user admin on >{passwords['worker']}-admin ~* &* +@all\n"  # the test's own view of the keys
    (d / "redis-acl.conf").write_text(acl)
    port = free_port()
    conf = d / "redis.conf"
    conf.write_text(
        f'port 0\ntls-port {port}\nbind 127.0.0.1\ndir {d}\nsave ""\nappendonly no\n'
        f"tls-cert-file {d / 'server.crt'}\ntls-key-file {d / 'server.key'}\ntls-ca-cert-file {d / 'ca.crt'}\n"
        f"tls-auth-clients yes\ninclude {d / 'redis-acl.conf'}\n"
    )
    with Processes(d) as procs:
        proc = procs.start("redis", [redis_binary(), str(conf)])
        wait_until_sync(lambda: proc.poll() is not None or _tls_ping(port, d), 10, what="the TLS redis-server")
        procs.check(proc)
        passwords["admin"] = f"{passwords['worker']}-admin"
        yield TlsRedis(port, run, d / "ca.crt", d / "client.crt", d / "client.key", passwords)
