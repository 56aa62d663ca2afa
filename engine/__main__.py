"""`python -m engine ...`: the same as `rollq engine ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.cli import add_arguments, run_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description="serve an SGLang-protocol inference engine")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return run_engine(args)


if __name__ == "__main__":
    sys.exit(main())
