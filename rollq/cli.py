"""`rollq` console script. Each service registers its own subcommands; this module only wires them together and
turns an unreachable Redis into one clear line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.config import ConfigError, read_document
from protocol.connection import DEFAULT_REDIS_URL, REDIS_URL_ENV
from rollq import settings


def redis_hint(url: str, reason: str) -> str:
    port = url.rsplit(":", 1)[-1].split("/")[0] if url.count(":") >= 2 else "6379"
    return (
        f"rollq: cannot reach Redis at {url} ({reason}). Start one with `redis-server --port {port} --daemonize yes` "
        f"or point --redis / {REDIS_URL_ENV} at a running server."
    )


def build_parser() -> argparse.ArgumentParser:
    from engine import cli as engine_cli
    from producer import cli as producer_cli
    from trainer import cli as trainer_cli
    from workers import cli as workers_cli
    from workers import reward_cli

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help=f"Redis URL (default: ${REDIS_URL_ENV} or {DEFAULT_REDIS_URL})",
    )
    common.add_argument("--run", default=None,
                        help="run name; namespaces every stream and key (default: $ROLLQ_RUN, the config's, or default)")
    common.add_argument("--config", default=None, metavar="FILE",
                        help="YAML config shared by every service (its section for this command; ROLLQ_* variables "
                        "and flags override it)")
    common.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser = argparse.ArgumentParser(
        prog="rollq",
        description="Distributed rollouts for RL of LLMs and agents over Redis streams.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    workers_cli.register(sub, common)
    reward_cli.register(sub, common)
    producer_cli.register(sub, common)
    engine_cli.register(sub, common)
    trainer_cli.register(sub, common)
    return parser


def _config_path(argv: list[str]) -> str | None:
    """--config's value, found before parsing (the file supplies defaults, required options included)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line over the config file's section and the ROLLQ_* variables. Plain `rollq` is `rollq up`."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in subparsers and argv[0] not in ("-h", "--help")):
        argv = ["up", *argv]  # plain `rollq [KEY=VALUE ...]`: the embedded default run (`rollq --help` lists all)
    if argv[0] in ("-h", "--help"):
        parser.parse_args(argv)  # prints the help and exits
    command = argv[0]
    try:
        document = read_document(_config_path(argv))
        settings.apply(parser, subparsers, command, document)
    except ConfigError as exc:
        parser.exit(2, f"rollq {command}: {exc}\n")
    args = parser.parse_args(argv)
    try:
        settings.shared(args, document)
    except ConfigError as exc:
        parser.exit(2, f"rollq {command}: {exc}\n")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return handler(args)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        print(redis_hint(args.redis, str(exc) or type(exc).__name__), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
