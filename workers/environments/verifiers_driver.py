"""rollq's driver for verifiers environments: runs in the environment's own interpreter (the worker's
`verifiers_python`), standard library and verifiers only. Never imports rollq.

    python verifiers_driver.py --check ENV_ID   exit 0 when verifiers can load ENV_ID, else one line on stderr, exit 3
    python verifiers_driver.py < payload.json   one episode (see rollq.workers.environments.agent for the payload)
"""

from __future__ import annotations

import sys

CHECK_FAILED = 3


def check(env_id: str) -> int:
    try:
        from verifiers.v1.utils.loaders import taskset_class
    except Exception as exc:  # not installed, or broken: either way this interpreter cannot run it
        return _refuse(f"verifiers is not importable by {sys.executable}: {type(exc).__name__}: {exc}")
    try:
        taskset_class(env_id)
    except Exception as exc:
        return _refuse(f"verifiers cannot load environment {env_id!r}: {type(exc).__name__}: {exc}")
    return 0


def _refuse(message: str) -> int:
    print(" ".join(message.split()), file=sys.stderr)  # one line
    return CHECK_FAILED


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--check":
        return check(argv[1])
    print("usage: verifiers_driver.py --check ENV_ID | verifiers_driver.py < payload.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
