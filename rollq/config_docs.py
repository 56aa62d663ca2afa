"""The generated reference pages of the docs site: docs/config.md (every setting) and docs/commands.md (every
command with its flags), rendered from the settings Structs (the same source as the flags), and
docs/ingress-openapi.json (the ingress's OpenAPI document, as `GET /openapi.json` serves it). `python -m
rollq.config_docs` writes them; `--check` exits 1 when any has drifted (a test runs it)."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from rollq.cli import COMMANDS, Command, command_fields, describe_default, usage
from rollq.config import RunSettings, SettingField, fields_of
from rollq.producer.ingress.models import openapi

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_MD = REPO_ROOT / "docs" / "config.md"
COMMANDS_MD = REPO_ROOT / "docs" / "commands.md"
OPENAPI_JSON = REPO_ROOT / "docs" / "ingress-openapi.json"

INTRO = """\
# Configuration reference

After this page you can set any rollq setting in the config file, an environment variable or a flag, and look up
each one's type, default and meaning. The commands and their flags at a glance: [commands](commands.md).

Every rollq service reads its settings from one place, in layers, each over the one before:

1. the defaults below;
2. the config file given with `--config FILE` (YAML): the shared keys at the top level, and one section per command;
3. environment variables: `ROLLQ_REDIS_URL`, `ROLLQ_RUN`, and `ROLLQ_<SECTION>_<KEY>` for a section's setting;
4. the command's flags (and, for `rollq train` / `rollq up`, `KEY=VALUE` arguments for the `trainer` section).

```yaml
redis_url: redis://redis:6379/0          # shared by every service
run: my-run
worker:  {concurrency: 64, engine: [http://engine-0:30000], allow: [my_pkg]}
engine:  {backend: reference, model: tiny, register: true}
trainer: {steps: 500, group_size: 8, groups_per_step: 32, max_staleness: 2}
```

Variables and flags are read as YAML scalars or flow collections (`3`, `true`, `[a, b]`, `{k: v}`), except text
settings, which take the value as it is. A repeatable flag (`--engine URL --engine URL`) replaces the file's list.
An unknown key, a value of the wrong type or out of range stops the command with exit code 2 and one line naming
the setting.

This page is generated from the settings Structs (`python -m rollq.config_docs`), as are the flags and `--help`.
"""


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " \\| ".join([*map(type_name, rest), "null"])
    if typing.get_origin(tp) is list:
        return f"list of {type_name(args[0])}"
    if typing.get_origin(tp) is dict or tp is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(command: Command) -> str:
    return f"rollq-{command.name}"


def shared_fields() -> dict[str, SettingField]:
    """The shared keys as RunSettings declares them (a command may give one its own meaning, e.g. `rollq up`)."""
    return {f.name: f for f in fields_of(RunSettings)}


def shared_rows() -> list[str]:
    rows = ["| key | flag | variable | default | meaning |", "|---|---|---|---|---|"]
    for f in shared_fields().values():
        rows.append(f"| `{f.name}` | `{f.flag}` | `{f.env('')}` | `{f.default}` | {_cell(f.doc)} |")
    return rows


def setting_row(section: str, field: SettingField) -> str:
    default = describe_default(field)
    flag = field.name if field.positional else field.flag
    return (
        f"| `{field.name}` | `{flag}` | `{field.env(section)}` | {type_name(field.type)} | "
        f"{f'`{default}`' if default and not field.required else default} | {_cell(field.doc)} |"
    )


def render_config_md() -> str:
    out = [INTRO, "## Shared keys (top level of the file)", "", *shared_rows(), ""]
    for command in COMMANDS:
        out += [f"## `rollq {command.name}`", "", f"{command.help[:1].upper()}{command.help[1:]}."]
        sections = ", ".join(f"`{s.name}`" for s in command.sections)
        out += [
            "",
            f"Section{'s' if len(command.sections) > 1 else ''} {sections}"
            + (f"; the `{command.key_values}` settings are also `KEY=VALUE` arguments." if command.key_values else "."),
            "",
        ]
        out += ["| setting | flag | variable | type | default | meaning |", "|---|---|---|---|---|---|"]
        shared = shared_fields()
        for section, field in command_fields(command):
            if not field.shared or field.doc != shared[field.name].doc:
                out.append(setting_row(section.name, field))
        out.append("")
    return "\n".join(out)


COMMANDS_INTRO = """\
# Commands

After this page you can find the `rollq` command for each service and the flags it takes.

Every command takes `--redis URL` (default `$ROLLQ_REDIS_URL`, then the config file's, then
`redis://localhost:6379/0`), `--run NAME` (default `$ROLLQ_RUN`, the config file's, or `default`), which namespaces
every key, so several runs and tenants share one Redis, and `--config FILE`. When Redis can't be reached, every
command says so in one line with how to start it. `rollq` with no command runs `rollq up`. `rollq COMMAND --help`
lists a command's settings; every one of them is also a config key and a variable
([configuration reference](config.md), generated from the same Structs).

This page is generated from the settings Structs (`python -m rollq.config_docs`).

"""


def render_commands_md() -> str:
    rows = ["| command | what it does |", "|---|---|"]
    for command in COMMANDS:
        options = [
            usage(f) if f.positional or f.required else f"[{usage(f)}]"
            for _, f in command_fields(command)
            if not f.shared
        ]
        if command.key_values:
            options.append("[KEY=VALUE ...]")
        line = " ".join([f"rollq {command.name}", *options])
        rows.append(f"| `{_cell(line)}` | {_cell(command.help)} ([settings](config.md#{_anchor(command)})) |")
    return COMMANDS_INTRO + "\n".join(rows) + "\n"


def render_openapi_json() -> str:
    return json.dumps(openapi(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollq.config_docs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated page has drifted")
    args = parser.parse_args(argv)
    wanted = {CONFIG_MD: render_config_md(), COMMANDS_MD: render_commands_md(), OPENAPI_JSON: render_openapi_json()}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.name} is out of date: run `python -m rollq.config_docs`", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
