"""`rollq train` with `nproc` above 1 on a machine not yet under torchrun: the same command under torchrun.

The resolved settings go to a config file in the run directory (owner-only: it may hold the engines' keys), so
every rank, and every restart of the group, reads exactly what this invocation resolved. torchrun's elastic agent
restarts the whole group up to `max_restarts` times when a rank dies; each restart resumes from the last checkpoint.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import msgspec

from rollq.config import SHARED_KEYS
from rollq.trainer.config import TrainConfig

CONFIG_FILE = "ranks.yaml"


def write_config(cfg: TrainConfig, path: Path) -> Path:
    """`cfg` as a config file `rollq train --config` reads (JSON is YAML), with nproc 1 (the ranks run torchrun's
    command; they must not launch again)."""
    values = msgspec.to_builtins(msgspec.structs.replace(cfg, nproc=1))
    document = {k: v for k, v in values.items() if k in SHARED_KEYS}
    document["trainer"] = {k: v for k, v in values.items() if k not in SHARED_KEYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(document))
    os.replace(tmp, path)
    return path


def torchrun_argv(cfg: TrainConfig, config: Path, *, log_level: str = "INFO") -> list[str]:
    """The torchrun command that runs `rollq train` as `cfg.nproc` ranks on this machine (rendezvous on a free
    local port: `--standalone`)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(cfg.nproc),
        "--max-restarts",
        str(cfg.max_restarts),
        "-m",
        "rollq",
        "train",
        "--log-level",
        log_level,
        "--config",
        str(config),
    ]


def launch(cfg: TrainConfig) -> int:
    """Run `cfg` under torchrun and wait; its exit status (0 when every rank finished)."""
    import subprocess

    config = write_config(cfg, Path(cfg.directory) / CONFIG_FILE)
    return subprocess.call(torchrun_argv(cfg, config))


__all__ = ["CONFIG_FILE", "launch", "torchrun_argv", "write_config"]
