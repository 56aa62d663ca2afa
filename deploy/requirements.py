"""Print rollq's requirements (its dependencies plus those of the given extras, self-references such as
`rollq[reference]` followed) one per line, read from pyproject.toml alone.

The Dockerfile installs them in a layer of their own (`python requirements.py pyproject.toml trainer`), so a change
to rollq's source does not reinstall torch and transformers; only a change to pyproject.toml does.
"""

from __future__ import annotations

import re
import sys
import tomllib

SELF = re.compile(r"^rollq\[([^\]]+)\]$")


def requirements(project: dict, extras: list[str]) -> list[str]:
    optional = project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise SystemExit(f"requirements.py: rollq has no extra {extra!r} (known: {', '.join(sorted(optional))})")
        for req in optional[extra]:
            match = SELF.match(req.replace(" ", ""))
            if match:
                todo += match.group(1).split(",")
            elif req not in out:
                out.append(req)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python requirements.py PYPROJECT [EXTRA[,EXTRA...] ...]", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        project = tomllib.load(f)["project"]
    extras = [e for arg in argv[1:] for e in arg.split(",") if e]  # `trainer smollm2` or `trainer,smollm2`
    print("\n".join(requirements(project, extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
