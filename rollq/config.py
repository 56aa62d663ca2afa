"""Typed settings for every rollq service, from one source: each service declares a `Settings` Struct (a field per
setting, its type, default, constraints and a one-line doc in `setting(...)`), and that Struct alone gives its
YAML keys, its `ROLLQ_<SECTION>_<KEY>` variables, its command-line flags (rollq.cli) and docs/config.md.

    redis_url: redis://redis:6379/0        # shared: every service (flag --redis, ROLLQ_REDIS_URL)
    run: my-run                            # shared (flag --run, ROLLQ_RUN)
    worker:  {concurrency: 64, engine: [http://engine-0:30000]}
    engine:  {backend: reference, model: tiny, register: true}
    trainer: {steps: 200, group_size: 8, max_staleness: 2}

Layers, each over the one before: the Struct's defaults, the file's section, the environment, then flags (or
`KEY=VALUE` overrides). A section is named after its `rollq` command (`reward-worker` -> `reward_worker`; the trainer's
settings, used by `rollq train` and `rollq up`, are `trainer`). Environment and command-line values are read as YAML
scalars or flow collections (`3`, `true`, `[a, b]`, `{k: v}`), except for text settings, which take them as they are.

A leaf module: services import it for `Settings` / `setting`; it imports no service and not the CLI.
"""

from __future__ import annotations

import functools
import os
import re
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

ENV_PREFIX = "ROLLQ_"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_RUN = "default"
_RUN_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"  # the pattern protocol.keys enforces on run names


class ConfigError(ValueError):
    """A config file, variable, flag or override that can't be used; the message names it."""


def setting(
    description: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    group: str | None = None,
    positional: bool = False,
    shared: bool = False,
    **constraints: Any,
) -> msgspec.Meta:
    """A setting's metadata for `Annotated[type, setting(...)]`: its one-line doc, msgspec constraints (`ge=1`,
    `gt=0`, `pattern=...`) and how the command line shows it (`flag` when not `--<name>`, `metavar`, the help
    `group`, `positional`). `shared`: a top-level key of the file (redis_url, run) rather than a section key."""
    extra: dict[str, str | bool] = {
        k: v for k, v in (("flag", flag), ("metavar", metavar), ("group", group)) if v is not None
    }
    if positional:
        extra["positional"] = True
    if shared:
        extra["shared"] = True
    return msgspec.Meta(description=description, extra=extra or None, **constraints)


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every service's settings. Built from Python, a file or flags, a value is checked against its
    field's type and constraints (msgspec checks them only when decoding, so construction checks them here)."""

    @classmethod
    def implied(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults that follow from the values given (a model's own task, say): applied under them, so anything
        given explicitly (file, variable, flag) still wins. None by default."""
        return {}

    def __post_init__(self) -> None:
        try:
            msgspec.convert(msgspec.structs.asdict(self), _checker(type(self)))
        except msgspec.ValidationError as exc:
            raise ValueError(readable(exc)) from None


class RunSettings(Settings, kw_only=True):
    """The two keys every service shares: where Redis is and which run (key namespace) to serve."""

    redis_url: Annotated[str, setting("Redis URL", flag="--redis", metavar="URL", shared=True)] = DEFAULT_REDIS_URL
    run: Annotated[str, setting("run name; namespaces every stream and key", shared=True, pattern=_RUN_NAME)] = (
        DEFAULT_RUN
    )
    redis_outage_s: Annotated[
        float,
        setting("how long a process rides out Redis being away (restart, failover) before it exits", shared=True, ge=0),
    ] = 60.0
    redis_tls_ca: Annotated[
        str | None, setting("CA certificate (PEM) that signed Redis's TLS certificate (rediss://)", shared=True)
    ] = None
    redis_tls_cert: Annotated[
        str | None, setting("client certificate (PEM) for Redis TLS (with tls-auth-clients yes)", shared=True)
    ] = None
    redis_tls_key: Annotated[str | None, setting("private key (PEM) of redis_tls_cert", shared=True)] = None
    redis_cluster: Annotated[
        bool, setting("redis_url is a node of a Redis Cluster (the client discovers the others)", shared=True)
    ] = False
    reward_redis_url: Annotated[
        str | None,
        setting(
            "plain Redis for remote rewards' arq queue (arq has no Redis Cluster support); default: redis_url",
            metavar="URL",
            shared=True,
        ),
    ] = None
    partitions: Annotated[
        int,
        setting(
            "partitions of the run's queue (each its own hash tag, so a Redis Cluster spreads them); 0 = follow "
            "the run's. Set by the first process that names one (or writes jobs: 1); later ones must agree",
            shared=True,
            ge=0,
            le=1024,
        ),
    ] = 0

    trace_endpoint: Annotated[
        str,
        setting(
            "OTLP/HTTP endpoint rollout traces go to, e.g. MLflow's http://HOST:5000/v1/traces ('' = "
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing; 'off' = none)",
            metavar="URL",
            shared=True,
        ),
    ] = ""
    trace_headers: Annotated[
        str,
        setting(
            "headers sent with traces, k=v,k2=v2 (e.g. x-mlflow-experiment-id=1; '' = OTEL_EXPORTER_OTLP_HEADERS)",
            metavar="K=V,...",
            shared=True,
        ),
    ] = ""
    trace_sample_rate: Annotated[
        float | None,
        setting(
            "share of jobs traced (0 to 1), decided at submit for the whole trace (default: OTEL_TRACES_SAMPLER, "
            "else all)",
            shared=True,
        ),
    ] = None
    trace_service: Annotated[
        str, setting("service name of this process's spans ('' = OTEL_SERVICE_NAME, else rollq-COMMAND)", shared=True)
    ] = ""
    trace_text: Annotated[
        bool,
        setting(
            "record text in spans: prompts, completions (and token ids), error messages, agents' output and "
            "commands' arguments; off by default (errors by their type alone): traces leave the trust boundary",
            shared=True,
        ),
    ] = False
    trace_text_chars: Annotated[
        int, setting("with trace_text: each recorded text cut to this many characters", shared=True, ge=1)
    ] = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.trace_sample_rate is not None and not 0 <= self.trace_sample_rate <= 1:
            raise ValueError(f"trace_sample_rate: {self.trace_sample_rate} is not between 0 and 1")
        try:
            self.redis_url = with_tls(self.redis_url, self.redis_tls_ca, self.redis_tls_cert, self.redis_tls_key)
        except ValueError as exc:
            raise ValueError(f"redis_url: {exc}") from None
        if self.redis_cluster:
            self.redis_url = with_query(self.redis_url, {CLUSTER_QUERY_ARG: "yes"})

    @property
    def rewards_url(self) -> str:
        """Where remote rewards' arq queue lives: reward_redis_url, else redis_url."""
        return self.reward_redis_url or self.redis_url


# RunSettings' TLS paths as the query arguments of a Redis URL that redis-py's from_url reads (and
# rollq.redis_client.arq_settings), so every client built from `redis_url` uses them.
TLS_QUERY_ARGS = {"ca": "ssl_ca_certs", "cert": "ssl_certfile", "key": "ssl_keyfile"}
# RunSettings.redis_cluster as a query argument of the URL (rollq.redis_client builds a cluster client for it).
CLUSTER_QUERY_ARG = "cluster"


def with_query(url: str, args: dict[str, str]) -> str:
    """`url` with query arguments added (an argument already in the URL wins)."""
    from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = parse_qs(parts.query)
    for name, value in args.items():
        query.setdefault(name, [value])
    return urlunsplit(parts._replace(query=urlencode(query, doseq=True)))


def with_tls(url: str, ca: str | None = None, cert: str | None = None, key: str | None = None) -> str:
    """`url` with the TLS files added as query arguments (an argument already in the URL wins)."""
    from urllib.parse import urlsplit

    given = {name: value for name, value in (("ca", ca), ("cert", cert), ("key", key)) if value}
    if not given:
        return url
    scheme = urlsplit(url).scheme
    if scheme != "rediss":
        raise ValueError(f"redis_tls_{'/'.join(given)} need a rediss:// URL, not {scheme}://")
    if bool(cert) != bool(key):
        raise ValueError("redis_tls_cert and redis_tls_key go together")
    return with_query(url, {TLS_QUERY_ARGS[name]: value for name, value in given.items()})


@functools.cache
def _checker(cls: type[Settings]) -> type:
    """The same fields, types and constraints as `cls`, without its __post_init__ (which would recurse)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return msgspec.defstruct(f"{cls.__name__}Check", [(name, hints[name]) for name in cls.__struct_fields__])


def readable(exc: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.concurrency`" as "concurrency: expected `int` >= 1"."""
    text = str(exc)
    match = re.match(r"^(.*) - at `\$\.?(.*)`$", text)
    if not match:
        return text
    message, where = match.groups()
    return f"{where}: {message[:1].lower()}{message[1:]}" if where else message


class SettingField(msgspec.Struct, frozen=True):
    """One setting of a section, as the config file, the environment and the command line see it."""

    name: str
    type: Any  # the annotation without its metadata
    default: Any  # msgspec.NODEFAULT when required
    doc: str
    extra: dict[str, Any]

    @property
    def required(self) -> bool:
        return self.default is msgspec.NODEFAULT

    @property
    def shared(self) -> bool:
        return bool(self.extra.get("shared"))

    @property
    def positional(self) -> bool:
        return bool(self.extra.get("positional"))

    @property
    def flag(self) -> str:
        return str(self.extra.get("flag") or "--" + self.name.replace("_", "-"))

    def env(self, section: str) -> str:
        return ENV_PREFIX + (self.name if self.shared else f"{section}_{self.name}").upper()

    @property
    def text(self) -> bool:
        """Takes environment / command-line values as they are (no YAML reading)."""
        return _strip_none(self.type) is str

    def parse(self, raw: str) -> Any:
        return raw if self.text else parse_value(raw)


@functools.cache
def fields_of(cls: type[Settings]) -> tuple[SettingField, ...]:
    """The settings of `cls` in declaration order (read once per class)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    plain = typing.get_type_hints(cls)
    annotated = typing.get_type_hints(cls, include_extras=True)
    out = []
    for field in info.fields:
        meta = _meta(annotated[field.name])
        default = field.default
        if default is msgspec.NODEFAULT and field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        out.append(
            SettingField(
                name=field.name,
                type=plain[field.name],
                default=default,
                doc=(meta.description if meta else "") or "",
                extra=dict((meta.extra if meta else None) or {}),
            )
        )
    return tuple(out)


def _meta(annotation: Any) -> msgspec.Meta | None:
    if typing.get_origin(annotation) is Annotated:
        metas = [m for m in annotation.__metadata__ if isinstance(m, msgspec.Meta)]
        return metas[-1] if metas else None
    return None


def _strip_none(tp: Any) -> Any:
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


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


SHARED_KEYS = tuple(RunSettings.__struct_fields__)  # the top-level keys of the file: redis_url, run, redis_tls_*


def check_document(document: Mapping[str, Any], sections: Iterable[str]) -> None:
    """Every top-level key is a shared key or a known section, and every section is a mapping."""
    sections = list(sections)
    known = set(SHARED_KEYS) | set(sections)
    unknown = sorted(map(str, set(document) - known))
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for name in sections:
        if document.get(name) is not None and not isinstance(document[name], dict):
            raise ConfigError(f"config section {name!r} must be a mapping of settings")


def section_values(
    cls: type[Settings], section: str, document: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The settings of `cls` that the file (its section, and the shared top-level keys) and the environment give."""
    env = os.environ if env is None else env
    fields = {f.name: f for f in fields_of(cls)}
    values: dict[str, Any] = {}
    own = dict(document.get(section) or {})
    unknown = sorted(str(k) for k in own if k not in fields or fields[k].shared)
    if unknown:
        known = sorted(n for n, f in fields.items() if not f.shared)
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} in section {section!r}; known: {', '.join(known)}")
    for name, field in fields.items():
        if field.shared and document.get(name) is not None:
            values[name] = document[name]
    values.update(own)
    prefix = f"{ENV_PREFIX}{section.upper()}_"
    for var, raw in env.items():
        if var.startswith(prefix):
            key = var[len(prefix) :].lower()
            if key not in fields or fields[key].shared:
                known = sorted(n for n, f in fields.items() if not f.shared)
                raise ConfigError(
                    f"environment variable {var} names no setting of {section!r}; known: {', '.join(known)}"
                )
            values[key] = fields[key].parse(raw)
    for field in fields.values():
        if field.shared and env.get(field.env(section)):
            values[field.name] = env[field.env(section)]
    return values


def overrides(cls: type[Settings], items: Iterable[str]) -> dict[str, Any]:
    """`KEY=VALUE` command-line overrides of `cls`'s settings."""
    fields = {f.name: f for f in fields_of(cls) if not f.shared}
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ConfigError(f"override {item!r} must be KEY=VALUE with KEY one of: {', '.join(fields)}")
        values[key] = fields[key].parse(raw)
    return values


def build(cls: type[Settings], section: str, values: Mapping[str, Any]) -> Any:
    """`cls` from layered values (text from flags and variables converted to the fields' types)."""
    try:
        return msgspec.convert({**cls.implied(values), **values}, cls, strict=False)
    except msgspec.ValidationError as exc:
        message = readable(exc)
        missing = re.match(r"^Object missing required field `(\w+)`$", str(exc))
        if missing:
            field = next(f for f in fields_of(cls) if f.name == missing.group(1))
            given = "the positional argument" if field.positional else field.flag
            message = (
                f"{field.name} is required: give {given}, `{field.name}:` in section {section!r} "
                f"or {field.env(section)}"
            )
        raise ConfigError(f"section {section!r}: {message}") from None
    except ValueError as exc:  # a check across settings in __post_init__
        raise ConfigError(f"section {section!r}: {exc}") from None


def load(
    cls: type[Settings],
    section: str,
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    given: Mapping[str, Any] | None = None,
) -> Any:
    """`cls` from the config file `path` (its `section`), the environment and `given` values (flags), in that order."""
    values = section_values(cls, section, read_document(path), env)
    values.update(given or {})
    return build(cls, section, values)


__all__ = [
    "DEFAULT_REDIS_URL",
    "ENV_PREFIX",
    "SHARED_KEYS",
    "ConfigError",
    "RunSettings",
    "SettingField",
    "Settings",
    "build",
    "check_document",
    "fields_of",
    "load",
    "overrides",
    "parse_value",
    "read_document",
    "readable",
    "section_values",
    "setting",
]
