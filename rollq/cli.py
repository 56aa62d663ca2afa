"""The `rollq` command. Every subcommand's options come from its service's settings Struct (rollq.config): this
module only lists the commands, builds their flags from those Structs, layers file < environment < flags into typed
settings, and hands them to the service's entry function. An unreachable Redis becomes one clear line.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollq.config import (
    ConfigError,
    SettingField,
    Settings,
    build,
    check_document,
    fields_of,
    overrides,
    read_document,
    section_values,
)
from rollq.engine.server.config import EngineConfig
from rollq.engine.server.weight_agent.config import WeightAgentConfig
from rollq.keda import KedaConfig
from rollq.producer.config import ClassesConfig, EnqueueConfig, StatusConfig
from rollq.producer.ingress.config import IngressConfig
from rollq.redis_client import RedisUnavailable
from rollq.trainer.config import TrainConfig
from rollq.trainer.hf_export import ExportConfig
from rollq.trainer.plot_command import PlotConfig
from rollq.up import UpConfig
from rollq.workers.config import WorkerConfig
from rollq.workers.rewards.config import RewardWorkerConfig

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class Section(msgspec.Struct, frozen=True):
    name: str  # the config file's section (and ROLLQ_<NAME>_<KEY>)
    settings: type[Settings]


class Command(msgspec.Struct, frozen=True):
    name: str
    help: str
    entry: str  # "module:function", called with one settings object per section, in order
    sections: tuple[Section, ...]
    key_values: str = ""  # a section whose settings may also be given as KEY=VALUE arguments


TRAINER = Section("trainer", TrainConfig)
COMMANDS = (
    Command(
        "worker",
        "run a rollout worker (scale by starting more)",
        "rollq.workers.commands:worker",
        (Section("worker", WorkerConfig),),
    ),
    Command(
        "reward-worker",
        "run a reward worker for reward_mode=remote workflows (scale by starting more)",
        "rollq.workers.rewards.commands:reward_worker",
        (Section("reward_worker", RewardWorkerConfig),),
    ),
    Command(
        "enqueue",
        "submit one job per JSONL line",
        "rollq.producer.commands:enqueue",
        (Section("enqueue", EnqueueConfig),),
    ),
    Command(
        "status",
        "queue lengths, pending work, dead letters, live workers, the trainer's ledger",
        "rollq.producer.commands:status",
        (Section("status", StatusConfig),),
    ),
    Command(
        "classes",
        "list or set the run's job classes (priority, fair-share weight, admission budget)",
        "rollq.producer.classes:classes",
        (Section("classes", ClassesConfig),),
    ),
    Command(
        "ingress",
        "serve the HTTP ingress: other services submit jobs, stream results (SSE) and cancel",
        "rollq.producer.ingress.commands:ingress",
        (Section("ingress", IngressConfig),),
    ),
    Command(
        "engine",
        "serve an inference engine speaking SGLang's HTTP protocol",
        "rollq.engine.server.commands:engine",
        (Section("engine", EngineConfig),),
    ),
    Command(
        "weight-agent",
        "serve the host agent of an SGLang engine: rebuilds full weights from the trainer's deltas before the pause",
        "rollq.engine.server.weight_agent.commands:weight_agent",
        (Section("weight_agent", WeightAgentConfig),),
    ),
    Command(
        "train",
        "train against a running stack (Redis, engines, workers)",
        "rollq.trainer.commands:train",
        (TRAINER,),
        key_values="trainer",
    ),
    Command(
        "up",
        "everything on this machine: Redis (if none answers), reference engines, workers and the trainer "
        "on the toy task (the default command)",
        "rollq.up:up",
        (Section("up", UpConfig), TRAINER),
        key_values="trainer",
    ),
    Command(
        "export",
        "write a trained run's model as a Hugging Face model directory (for serving: transformers, SGLang, "
        "`rollq engine --model DIR`)",
        "rollq.trainer.hf_export:export",
        (Section("export", ExportConfig),),
    ),
    Command(
        "plot",
        "draw a run's plot.png again from its metrics.jsonl (after an interrupted run, or while one goes)",
        "rollq.trainer.plot_command:plot",
        (Section("plot", PlotConfig),),
    ),
    Command(
        "keda",
        "print the KEDA objects that scale the worker Deployment on a run's job streams (docs/keda.md)",
        "rollq.keda:keda",
        (Section("keda", KedaConfig),),
    ),
)
COMMANDS_BY_NAME = {c.name: c for c in COMMANDS}
SECTIONS = tuple(dict.fromkeys(s.name for c in COMMANDS for s in c.sections))


class Invocation(msgspec.Struct, frozen=True):
    """A parsed command line: the command and its typed settings, one per section."""

    command: Command
    settings: tuple[Any, ...]
    log_level: str = "INFO"

    def run(self) -> int:
        module, _, function = self.command.entry.partition(":")
        entry: Callable[..., int] = getattr(importlib.import_module(module), function)
        return entry(*self.settings)


def redis_hint(url: str, reason: str) -> str:
    port = url.rsplit(":", 1)[-1].split("/")[0] if url.count(":") >= 2 else "6379"
    return (
        f"rollq: cannot reach Redis at {url} ({reason}). Start one with `redis-server --port {port} --daemonize yes` "
        f"or point --redis / ROLLQ_REDIS_URL at a running server."
    )


def command_fields(command: Command) -> list[tuple[Section, SettingField]]:
    """Every setting of a command, each once (a shared key such as redis_url belongs to all its sections)."""
    seen: dict[str, str] = {}
    out = []
    for section in command.sections:
        for field in fields_of(section.settings):
            owner = seen.get(field.name)
            if owner is not None and not field.shared:
                raise TypeError(
                    f"rollq {command.name}: setting {field.name!r} is in sections {owner} and {section.name}"
                )
            if owner is None:
                seen[field.name] = section.name
                out.append((section, field))
    return out


def describe_default(field: SettingField) -> str:
    if field.required:
        return "required"
    if field.shared:
        return "" if field.default is None else f"${field.env('')} or {field.default}"
    if field.default in ("", None, [], {}):
        return ""
    if isinstance(field.default, bool):
        return "on" if field.default else "off"
    return str(field.default)


def field_help(field: SettingField, section: str) -> str:
    default = describe_default(field)
    parts = [field.doc]
    if default:
        parts.append(f"({'required' if field.required else 'default: ' + default})")
    parts.append(f"[{'' if field.shared else section + '.'}{field.name}, {field.env(section)}]")
    return " ".join(parts).replace("%", "%%")


_METAVARS: dict[Any, str] = {int: "N", float: "X", dict: "MAPPING"}


def _base(tp: Any) -> Any:
    return typing.get_origin(tp) or tp


def _choices(tp: Any) -> list[Any] | None:
    return list(typing.get_args(tp)) if typing.get_origin(tp) is Literal else None


def metavar(field: SettingField) -> str:
    return str(field.extra.get("metavar") or _METAVARS.get(_base(field.type), field.name.upper()))


def usage(field: SettingField) -> str:
    """How the flag is written: `--concurrency N`, `--wait`, `--backend synthetic|reference|sglang`."""
    if field.positional:
        return field.name.upper()
    if field.type is bool:
        return field.flag
    choices = _choices(field.type)
    return f"{field.flag} {'|'.join(map(str, choices)) if choices else metavar(field)}"


class _Options(Protocol):
    """A parser or one of its argument groups."""

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action: ...


def _add_option(parser: _Options, section: Section, field: SettingField) -> None:
    kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": field_help(field, section.name)}
    tp = field.type
    kwargs["metavar"] = metavar(field)
    if field.positional:
        del kwargs["dest"]
        parser.add_argument(field.name, nargs="?", **kwargs)
        return
    if tp is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        del kwargs["metavar"]
    elif typing.get_origin(tp) is list:
        kwargs["action"] = "append"
    else:
        choices = _choices(tp)
        if choices is not None:
            kwargs["choices"] = choices
            del kwargs["metavar"]
    parser.add_argument(field.flag, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollq",
        description="Distributed rollouts for RL of LLMs and agents over Redis streams. Every setting comes from "
        "the config file's section, a ROLLQ_* variable or a flag, each over the one before (docs/config.md).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        p.add_argument(
            "--config",
            default=None,
            metavar="FILE",
            help="YAML config shared by every service (its section for this command; ROLLQ_* variables "
            "and flags override it)",
        )
        p.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
        groups: dict[str, _Options] = {}
        for section, field in command_fields(command):
            group_name = field.extra.get("group")
            title = str(group_name) if group_name else ""
            if len(command.sections) > 1:  # `rollq up`: its own settings, then the trainer's
                title = f"{section.name} settings" + (f" ({group_name})" if group_name else "")
            if title and title not in groups:
                groups[title] = p.add_argument_group(title)
            _add_option(groups[title] if title else p, section, field)
        if command.key_values:
            p.add_argument(
                "overrides",
                nargs="*",
                metavar="KEY=VALUE",
                help=f"{command.key_values} settings, e.g. steps=200 lr=1e-4 (the same as their flags)",
            )
    return parser


def _given(namespace: argparse.Namespace, section: Section) -> dict[str, Any]:
    """What the command line gave for this section's settings (flag text read by each field's rule; a repeatable
    flag's items as they are)."""
    given: dict[str, Any] = {}
    for field in fields_of(section.settings):
        value = getattr(namespace, field.name, None)
        if value is not None:
            given[field.name] = field.parse(value) if isinstance(value, str) else value
    return given


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Invocation:
    """The command line over the config file's sections and the ROLLQ_* variables. Plain `rollq` is `rollq up`.
    Exits 2 with one line naming the setting when something can't be used."""
    env = os.environ if env is None else env
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS_BY_NAME and argv[0] not in ("-h", "--help")):
        argv = ["up", *argv]  # plain `rollq [KEY=VALUE ...]`: the embedded default run (`rollq --help` lists all)
    namespace = parser.parse_args(argv)
    command = COMMANDS_BY_NAME[namespace.command]
    try:
        document = read_document(namespace.config)
        check_document(document, SECTIONS)
        settings = []
        for section in command.sections:
            values = section_values(section.settings, section.name, document, env)
            values.update(_given(namespace, section))
            if section.name == command.key_values:
                values.update(overrides(section.settings, namespace.overrides))
            settings.append(build(section.settings, section.name, values))
    except ConfigError as exc:
        parser.exit(2, f"rollq {command.name}: {exc}\n")
    return Invocation(command=command, settings=tuple(settings), log_level=namespace.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    invocation = parse(argv)
    logging.basicConfig(
        level=getattr(logging, invocation.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return invocation.run()
    except RedisUnavailable as exc:  # an outage outlasted redis_outage_s
        print(f"rollq {invocation.command.name}: {exc}", file=sys.stderr)
        return 3
    except (RedisConnectionError, RedisTimeoutError) as exc:
        url = next((s.redis_url for s in invocation.settings if getattr(s, "redis_url", None)), "")
        print(redis_hint(url, str(exc) or type(exc).__name__), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


__all__ = ["COMMANDS", "Command", "Invocation", "Section", "build_parser", "main", "parse", "redis_hint"]


if __name__ == "__main__":
    sys.exit(main())
