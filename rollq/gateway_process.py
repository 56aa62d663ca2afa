"""SGLang's gateway (`smg`) as `rollq up` runs it in front of its engines (`gateway: smg`).

The gateway is a separate package (a Rust binary in a Python wheel, with its own dependencies), installed beside
rollq or on PATH, never imported here: it runs as a child, started by its own Python with its launcher
(`smg.launch_router`, what `smg launch` runs), so that its keys come through a pipe rather than its command line
(readable by every local user). Its flags, read from smg 1.13.0's `smg launch --help`:

- `--host 127.0.0.1 --prometheus-host 127.0.0.1`: both default to every interface.
- `--policy manual --assignment-mode min_group`: the manual policy pins each `X-SMG-Routing-Key` (a group's id) to
  one engine and never moves a key while its engine is healthy (a new engine takes new keys: min_group gives a new
  key to the engine holding fewest); a key whose engine failed moves to another.
- `--health-check-endpoint /model_info`: an engine paused for a weight update blocks `/health` (it runs a
  generation, as SGLang's does), and after `--health-failure-threshold` timed-out checks the gateway would take
  every engine out and answer 503 to new requests for the rest of the pause (sglang-router 0.3.2 measured:
  ../shared/findings/sglang-router.md 4.1). `/model_info` answers while paused.
- `--control-plane-api-keys rollq:rollq:admin:KEY`: its `/workers` routes need the key (open to anyone otherwise);
  `--api-key KEY`: the engines' api key, which it sends them and which its own data plane then asks of callers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass

INSTALL_HINT = (
    "rollq up's gateway needs SGLang's gateway, the `smg` package: `uv tool install smg==1.13.0` (or `pipx install "
    "smg==1.13.0`) puts its `smg` on PATH; `pip install smg==1.13.0` into rollq's environment works too (a later `uv "
    "sync` removes it again)"
)

# Run by the gateway's own Python: the keys come from the pipe named by argv[1], the flags after it (smg's launcher,
# smg/launch_router.py: parse_router_args + launch_router).
LAUNCH = """\
import json, sys
from smg.launch_router import launch_router, parse_router_args
with open(sys.argv[1]) as handed:
    keys = json.load(handed)
flags = sys.argv[2:] + ["--control-plane-api-keys", "rollq:rollq:admin:" + keys["admin_api_key"]]
if keys.get("api_key"):
    flags += ["--api-key", keys["api_key"]]
launch_router(parse_router_args(flags))
"""


class GatewayMissing(RuntimeError):
    """No smg to start: the message says how to install it."""


def smg_python() -> str:
    """The Python that runs smg: this one when smg is importable here, else the interpreter of the `smg` script on
    PATH (a `uv tool` or pipx install has its own environment)."""
    if importlib.util.find_spec("smg") is not None:
        return sys.executable
    script = shutil.which("smg")
    if script is None:
        raise GatewayMissing(f"no `smg` on PATH, and smg is not installed beside rollq: {INSTALL_HINT}")
    with open(script, "rb") as f:
        first = f.readline().decode(errors="replace").strip()
    python = first[2:].strip().split(" ")[0] if first.startswith("#!") else ""
    if not python or not os.access(python, os.X_OK):
        said = f"its first line: {first[:80]!r}"
        raise GatewayMissing(f"{script} is not smg's Python entry point ({said}): {INSTALL_HINT}")
    return python


@dataclass(frozen=True)
class GatewayFlags:
    """How `rollq up` runs smg (see the module's docstring for why each)."""

    port: int
    prometheus_port: int
    health_interval_s: int = 5
    health_timeout_s: int = 5
    health_failures: int = 3

    def argv(self, python: str, handed_path: str) -> list[str]:
        return [
            *[python, "-c", LAUNCH, handed_path],
            *["--host", "127.0.0.1", "--port", str(self.port)],
            *["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port)],
            *["--policy", "manual", "--assignment-mode", "min_group"],
            *["--health-check-endpoint", "/model_info"],
            *["--health-check-interval-secs", str(self.health_interval_s)],
            *["--health-check-timeout-secs", str(self.health_timeout_s)],
            *["--health-failure-threshold", str(self.health_failures)],
            *["--log-level", "warn"],
        ]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


__all__ = ["INSTALL_HINT", "GatewayFlags", "GatewayMissing", "smg_python"]
