"""`python -m rollq.engine ...`: the same as `rollq engine ...` (an entry point, so it may use the CLI)."""

import sys

from rollq.cli import main

if __name__ == "__main__":
    sys.exit(main(["engine", *sys.argv[1:]]))
