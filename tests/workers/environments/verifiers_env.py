"""A verifiers environment written for the tests in verifiers' own API (verifiers 0.4.0, `import verifiers.v1 as
vf`; scaffolded as `vf-init` does, verifiers/v1/cli/init.py), installed as a package into the tests' verifiers
virtualenv, and that virtualenv.

`rollq-vf-digits`: `num_tasks` tasks asking for a number; one @reward, a checksum of the model's reply (of its ASCII
letters and digits), so the tiny model's gibberish gets rewards that differ from task to task (and equal ones for
equal replies). `failing: true` makes that reward raise: verifiers marks the episode failed. Its harness runs
in-process (verifiers/v1/harness.py, Harness.launch: a harness may run its loop in-process as long as every model
call goes through `endpoint` + `secret`): verifiers' `null` harness launches a PEP 723 script through `uv sync
--script`, which needs uv (not among verifiers' dependencies: it downloads it) and a package index, neither of which
a test here has.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.third_party import _locked, venv

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE.parent.parent / "environments" / "verifiers-requirements.txt"
ENV_ID = "rollq-vf-digits"
PACKAGE = "rollq_vf_digits"
VERSION = "0.1.0"

SOURCE = '''\
"""rollq's test environment: a reply's checksum as its reward."""

from openai import AsyncOpenAI

import verifiers.v1 as vf
from verifiers.v1.types import content_text


class DigitsData(vf.TaskData):
    failing: bool = False


class DigitsTask(vf.Task[DigitsData]):
    @vf.reward(weight=1.0)
    async def checksum(self, trace: vf.Trace) -> float:
        if self.data.failing:
            raise RuntimeError("the checksum reward failed on purpose")
        # its ASCII letters and digits: what any decoding of the reply's tokens agrees on (a byte-level model's
        # gibberish may split a character between tokens, which decoders replace differently)
        reply = content_text(trace.last_message.content)
        return (sum(ord(c) for c in reply if c.isascii() and c.isalnum()) % 11) / 10


class DigitsConfig(vf.TasksetConfig):
    num_tasks: int = 6
    failing: bool = False
    greeting: str = ""  # a string field: a job may not set it (it could name a file, a function or a server)


class DigitsTaskset(vf.Taskset[DigitsTask, DigitsConfig]):
    def load(self) -> list[DigitsTask]:
        return [
            DigitsTask(DigitsData(prompt=f"Write the number {i * 37}.", failing=self.config.failing), self.config.task)
            for i in range(self.config.num_tasks)
        ]


class DigitsHarnessConfig(vf.HarnessConfig):
    pass


class DigitsHarness(vf.Harness[DigitsHarnessConfig]):
    """One chat turn, in-process: the model call goes through the rollout's interception (`endpoint`, `secret`)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_text_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt or ""})
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["DigitsHarness", "DigitsTaskset"]
'''


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(folder: Path) -> Path:
    """The environment as a wheel (a zip a wheel's layout: no build backend needed, none is installed offline)."""
    info = f"{PACKAGE}-{VERSION}.dist-info"
    files = {
        f"{PACKAGE}/__init__.py": SOURCE.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {ENV_ID}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: rollq-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = folder / f"{PACKAGE}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def verifiers_python(tmp: Path) -> Path:
    """The tests' verifiers virtualenv (built once from cached wheels) with this environment installed (again each
    time: a test may have changed its source)."""
    python = venv("verifiers", REQUIREMENTS)
    wheel = build_wheel(tmp)
    with _locked("venvs"):
        subprocess.run(
            [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python), "install", "-q"]
            + ["--no-deps", "--no-index", "--force-reinstall", str(wheel)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    return python
