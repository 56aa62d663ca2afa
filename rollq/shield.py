"""Secrets out of reach of other processes of the same user: every rollq process that holds a secret (a Redis URL
with its password, engine keys, tenant tokens) calls `shield_secrets()` once its settings are read.

Agents under training run as the same user as the worker, and often as the same user as everything `rollq up` or a
hand-started stack runs. Two things of a process are readable by any process of its user: `/proc/<pid>/environ`
(the environment it started with, whatever it unset since: the kernel reads it from the process's memory) and its
memory. A process made non-dumpable (`PR_SET_DUMPABLE` 0) has both closed to them (root, or CAP_SYS_PTRACE, still
reads them). `/proc/<pid>/cmdline` stays readable: secrets never go on a command line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

# Names of rollq's own settings and credentials: its Redis URL and password, engine keys, every ROLLQ_ setting.
SECRET_PREFIXES = ("ROLLQ_", "REDIS")
# Kept by a shielded process: where the offline models are built (a path, and the process builds or loads a model
# after it shields) and the range local ports come from (rollq.local.free_port: a process picks ports for its
# children after it shields). Agents get no ROLLQ_* at all (rollq.workers.agents.environment).
NOT_SECRET = frozenset({"ROLLQ_CACHE", "ROLLQ_LOCAL_PORTS"})
_PR_SET_DUMPABLE = 4


def is_secret(name: str) -> bool:
    return name.upper().startswith(SECRET_PREFIXES)


def drop_secrets(environ: MutableMapping[str, str] = os.environ, keep: frozenset[str] = NOT_SECRET) -> None:
    """Removes rollq's settings and credentials from `environ` (os.environ: this process's, and what it starts from
    now on), but the names in `keep`."""
    for name in [name for name in environ if is_secret(name) and name not in keep]:
        del environ[name]


def make_non_dumpable() -> None:
    """On Linux: processes of the same user can no longer read this process's /proc/<pid>/environ, memory or file
    descriptors, nor trace it (py-spy needs root from now on). Inherited by fork, reset by exec: a program this
    process starts is dumpable again, so it gets no secret in its environment or on its command line."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def shield_secrets() -> None:
    """Call once the settings are read: the secrets leave the environment (so nothing started from here on inherits
    them) and the process becomes non-dumpable (so the environment it started with can't be read either)."""
    drop_secrets(os.environ)
    make_non_dumpable()


__all__ = ["NOT_SECRET", "SECRET_PREFIXES", "drop_secrets", "is_secret", "make_non_dumpable", "shield_secrets"]
