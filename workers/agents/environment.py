"""The environment of the processes that run agents: what a command agent starts with, what a job may add to it, and
the worker's secrets stripped from the agent processes the worker starts.

Agents run the code under training (and often what the model writes), so they never get the worker's credentials:
`ROLLQ_REDIS_URL` (with its password) reaches the whole run, engine keys reach the engines' control routes.

- A command agent starts from nothing: `PATH` (the worker's, or the system default), `HOME` and `TMPDIR` (a fresh
  folder per episode, removed after it: the worker's home holds credentials that tools read on their own, such as
  ~/.netrc, ~/.git-credentials, ~/.aws, a Hugging Face token, and episodes must not see each other's files), `LANG`
  and the worker's `LC_*` locale settings, the four proxy variables, then what the job passes in its
  `workflow_kwargs: {"env": {...}}`. A job may set only names the operator allowed with `env:NAME` patterns (a job
  that sets LD_PRELOAD, PYTHONPATH or NODE_OPTIONS runs what the allowlist refused), never ROLLQ_* or the proxy
  variables.
- Python agents in their own processes (subproc mode's pool, agent hosts) run in a copy of the worker's environment
  with the worker's secrets (`ROLLQ_*`, `REDIS*`) removed first, so neither they nor what they start see them; the
  rest (CUDA, caches, their own API keys) they may need.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

import msgspec

from rollq.shield import SECRET_PREFIXES, drop_secrets, is_secret
from rollq.workers.resolver import Allowlist, ImportNotAllowed, WorkflowLoadError

# Names of the worker's own credentials and settings: its Redis URL and password, engine keys, every ROLLQ_ setting.
WORKER_SECRET_PREFIXES = SECRET_PREFIXES
PROXY_VARIABLES = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")
DEFAULT_LANG = "C.UTF-8"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class CommandOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A command agent's workflow_kwargs."""

    env: dict[str, str] = {}  # variables added to the agent's environment (each name allowed by an `env:` pattern)


def command_options(kwargs: Mapping[str, object], allowlist: Allowlist | None) -> CommandOptions:
    """A job's workflow_kwargs for a command agent, checked: typed, valid names, allowed by the allowlist."""
    try:
        options = msgspec.convert(kwargs, CommandOptions)
    except msgspec.ValidationError as exc:
        raise WorkflowLoadError(
            f"a command agent's workflow_kwargs may hold only env, a mapping of variable names to strings: {exc}"
        ) from None
    for name, value in options.env.items():
        if not _ENV_NAME.match(name):
            raise WorkflowLoadError(
                f"{name!r} is not an environment variable name (letters, digits and _, not starting with a digit)"
            )
        if "\0" in value:
            raise WorkflowLoadError(f"environment variable {name!r} holds a NUL character")
        if name.startswith("ROLLQ_") or name in PROXY_VARIABLES:
            raise ImportNotAllowed(
                f"a job may not set {name!r}: the worker's settings (ROLLQ_*) and the proxy variables are the worker's"
            )
        if allowlist is not None:
            allowlist.check_env(name)
    return options


def proxy_variables(base_url: str, api_key: str, anthropic_base_url: str) -> dict[str, str]:
    """What points an unmodified agent on the official SDKs at the recording proxy, with the episode's key."""
    return {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": anthropic_base_url,
        "ANTHROPIC_API_KEY": api_key,
    }


def command_environment(
    home: str, tmpdir: str, proxy: Mapping[str, str], passed: Mapping[str, str], worker: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """A command agent's whole environment (nothing else of the worker's reaches it)."""
    env = {"PATH": worker.get("PATH") or os.defpath, "HOME": home, "TMPDIR": tmpdir}
    env["LANG"] = worker.get("LANG") or DEFAULT_LANG
    env.update((name, value) for name, value in worker.items() if name.startswith("LC_"))
    env.update(passed)
    env.update(proxy)  # last: a job cannot redirect the agent (command_options refuses these names anyway)
    return env


def is_worker_secret(name: str) -> bool:
    return is_secret(name)


def drop_worker_secrets(environ: MutableMapping[str, str] = os.environ) -> None:
    """Removes the worker's secrets from `environ` (os.environ: this process's, and what it starts from now on)."""
    drop_secrets(environ, keep=frozenset())


__all__ = [
    "PROXY_VARIABLES",
    "WORKER_SECRET_PREFIXES",
    "CommandOptions",
    "command_environment",
    "command_options",
    "drop_worker_secrets",
    "is_worker_secret",
    "proxy_variables",
]
