"""The shared config file and `ROLLQ_*` variables applied to a command's options (see protocol.config).

A command's section sets the defaults of its options (keys are the option names with `_`: `max_attempts` for
`--max-attempts`), typed by the options' own declarations; flags given on the command line win.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from protocol.config import ConfigError, check_document, section_settings, shared_value

TRAINER_SECTION = "trainer"  # TrainConfig's settings (rollq train / rollq up), read by the trainer itself
_NOT_SETTINGS = {"help", "config", "redis", "run", "log_level"}  # common options: shared keys, not section keys


def section_name(command: str) -> str:
    return command.replace("-", "_")


def _setting_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in _NOT_SETTINGS}


def _action_type(action: argparse.Action) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return bool
    base = action.type if isinstance(action.type, type) else str
    if isinstance(action, argparse._AppendAction):
        return list[base]
    return base | None if action.default is None else base


def typed_settings(parser: argparse.ArgumentParser, section: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` checked against the options' types and choices (ConfigError names the setting)."""
    actions = _setting_actions(parser)
    spec = msgspec.defstruct(f"{section}_settings", [(k, _action_type(actions[k])) for k in values],
                             kw_only=True, forbid_unknown_fields=True)
    try:
        typed = msgspec.to_builtins(msgspec.convert(dict(values), spec, strict=False))
    except msgspec.ValidationError as exc:
        raise ConfigError(f"section {section!r}: {exc}") from None
    for key, value in typed.items():
        choices = actions[key].choices
        if choices is not None and value not in choices:
            raise ConfigError(f"section {section!r}: {key} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return typed


def apply(parser: argparse.ArgumentParser, subparsers: Mapping[str, argparse.ArgumentParser], command: str,
          document: Mapping[str, Any], env: Mapping[str, str] | None = None) -> None:
    """Set `command`'s option defaults from its config section and environment variables."""
    env = os.environ if env is None else env
    check_document(document, [*map(section_name, subparsers), TRAINER_SECTION])
    sub = subparsers[command]
    section = section_name(command)
    actions = _setting_actions(sub)
    typed = typed_settings(sub, section, section_settings(document, section, actions, env))
    for key in typed:
        actions[key].required = False  # given by the config
    sub.set_defaults(**typed)


def shared(args: argparse.Namespace, document: Mapping[str, Any], env: Mapping[str, str] | None = None) -> None:
    """--redis / --run: the flag, else ROLLQ_REDIS_URL / ROLLQ_RUN, else the file's, else the default."""
    from protocol.connection import DEFAULT_REDIS_URL

    given = args.redis or shared_value("redis_url", document, env)
    args.redis_given = bool(given)  # `rollq up` starts its own Redis only when none was asked for
    args.redis = given or DEFAULT_REDIS_URL
    args.run = args.run or shared_value("run", document, env) or "default"
    if not isinstance(args.redis, str) or not isinstance(args.run, str):
        raise ConfigError("redis_url and run must be strings")


__all__ = ["TRAINER_SECTION", "apply", "section_name", "shared", "typed_settings"]
