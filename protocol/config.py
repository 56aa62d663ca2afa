"""One config for every rollq service: a YAML file, then `ROLLQ_*` environment variables, then the command line,
each over the one before.

    redis_url: redis://redis:6379/0        # shared: every service
    run: my-run                            # shared
    worker:  {concurrency: 64, engine: [http://engine-0:30000]}
    engine:  {backend: reference, model: tiny, register: true}
    trainer: {steps: 200, group_size: 8, max_staleness: 2}

A section is named after its `rollq` command (`reward-worker` -> `reward_worker`; the trainer's settings, used by
`rollq train` and `rollq up`, are `trainer`). Environment: `ROLLQ_REDIS_URL`, `ROLLQ_RUN`, and
`ROLLQ_<SECTION>_<KEY>` (`ROLLQ_WORKER_CONCURRENCY=32`, `ROLLQ_TRAINER_STEPS=200`). Environment and command-line
values are YAML scalars or flow collections (`3`, `true`, `[a, b]`, `{k: v}`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "ROLLQ_"
SHARED_KEYS = ("redis_url", "run")


class ConfigError(ValueError):
    """A config file, variable or override that can't be used; the message names it."""


def parse_value(raw: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw  # not YAML (e.g. "a: b: c"): the string itself


def read_document(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The config file as a mapping ({} without a file)."""
    if path is None:
        return {}
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {str(exc).splitlines()[0]}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must be a mapping (shared keys and one section per service)")
    return loaded


def check_document(document: Mapping[str, Any], sections: Iterable[str]) -> None:
    known = set(SHARED_KEYS) | set(sections)
    unknown = sorted(set(document) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(map(str, unknown))}; known: {', '.join(sorted(known))}")
    for name in sections:
        if document.get(name) is not None and not isinstance(document[name], dict):
            raise ConfigError(f"config section {name!r} must be a mapping of settings")


def shared_value(key: str, document: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Any:
    """A shared key (redis_url, run): the environment's ROLLQ_<KEY>, else the file's, else None."""
    env = os.environ if env is None else env
    raw = env.get(ENV_PREFIX + key.upper())
    return raw if raw else document.get(key)


def section_settings(document: Mapping[str, Any], section: str, names: Iterable[str],
                     env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The section's settings from the file, overlaid by ROLLQ_<SECTION>_<KEY> variables. Keys must be in `names`."""
    names = set(names)
    settings = dict(document.get(section) or {})
    unknown = sorted(set(settings) - names)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(map(str, unknown))} in section {section!r}; "
                          f"known: {', '.join(sorted(names))}")
    prefix = f"{ENV_PREFIX}{section.upper()}_"
    for var, raw in (os.environ if env is None else env).items():
        if not var.startswith(prefix):
            continue
        key = var[len(prefix):].lower()
        if key not in names:
            raise ConfigError(f"environment variable {var} names no setting of {section!r}; "
                              f"known: {', '.join(sorted(names))}")
        settings[key] = parse_value(raw)
    return settings


__all__ = ["ConfigError", "ENV_PREFIX", "SHARED_KEYS", "check_document", "parse_value", "read_document",
           "section_settings", "shared_value"]
