"""`rollq engine --backend sglang`: run a real SGLang server (GPU machines) with the flags rollq relies on, wait until
it generates, keep it registered with the run's engine registry, and stop it with rollq."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
from pathlib import Path

import httpx
import msgspec

log = logging.getLogger("rollq.engine")


class SGLangLaunch(msgspec.Struct, kw_only=True):
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float = 0.8
    weight_version: str = "default"
    api_key: str | None = None
    admin_api_key: str | None = None
    skip_tokenizer_init: bool = True  # token in, token out: never re-tokenize
    extra_args: list[str] = []

    def secrets(self) -> dict[str, str]:
        """The keys as SGLang config-file entries: `--config FILE` turns `api-key: K` into `--api-key K` inside the
        server (server_args_config_parser.py in 0.5.23 and 0.5.5; the flags are the fields' names, arg_utils.py:290),
        so they never appear on a command line, which every local user can read (ps, /proc/PID/cmdline)."""
        keys = {"api-key": self.api_key, "admin-api-key": self.admin_api_key}
        return {name: key for name, key in keys.items() if key}

    def write_secrets(self, directory: Path) -> Path | None:
        """The keys in a YAML file only this user can read, in `directory`; None when there are no keys."""
        secrets = self.secrets()
        if not secrets:
            return None
        import yaml

        path = directory / "sglang-keys.yaml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(secrets, f)  # quoted as needed: a key that reads as a number or a bool stays a string
        return path

    def command(self, secrets_file: Path | None = None) -> list[str]:
        """The launch command; the keys (if any) go in `secrets_file` (write_secrets), never on the command line."""
        if self.secrets() and secrets_file is None:
            raise ValueError("the engine keys go in a file: command(self.write_secrets(directory))")
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--tp-size",
            str(self.tp_size),
            "--dp-size",
            str(self.dp_size),
            "--mem-fraction-static",
            str(self.mem_fraction_static),
            "--enable-metrics",
            "--weight-version",
            self.weight_version,
        ]
        if self.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if secrets_file is not None:
            cmd += ["--config", str(secrets_file)]
        return cmd + list(self.extra_args)


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


async def wait_ready(url: str, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Ready when /health_generate answers 200 (a one-token generation succeeded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient() as client:
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"sglang exited with {proc.returncode} before it was ready")
            try:
                if (await client.get(url + "/health_generate", timeout=5)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"sglang at {url} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(1.0)
