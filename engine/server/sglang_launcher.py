"""`rollq engine --backend sglang`: run a real SGLang server (GPU machines) with the flags rollq relies on, wait until
it generates, keep it registered with the run's engine registry, and stop it with rollq."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys

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

    def command(self) -> list[str]:
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
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.admin_api_key:
            cmd += ["--admin-api-key", self.admin_api_key]
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
