"""`rollq` console script. Each service registers its own subcommands; this module only wires them together and
turns an unreachable Redis into one clear line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.connection import DEFAULT_REDIS_URL, REDIS_URL_ENV, redis_url_from_env


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
    common.add_argument("--run", default="default", help="run name; namespaces every stream and key (default: default)")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:  # plain `rollq`: the embedded default run (`rollq --help` lists the commands)
        args = parser.parse_args(["up", *(argv or [])])
        handler = args.handler
    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    args.redis = redis_url_from_env(args.redis)
    try:
        return handler(args)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        print(redis_hint(args.redis, str(exc) or type(exc).__name__), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
