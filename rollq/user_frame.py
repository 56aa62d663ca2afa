"""Where in the user's own code a failure happened: the innermost frame of a formatted traceback that is not rollq's,
the standard library's or an installed package's. "ZeroDivisionError: division by zero" says what; "my_rewards.py:7,
in mul_reward" says where to look (issue 44, F6)."""

from __future__ import annotations

import importlib.util
import os
import re
import sysconfig
from functools import cache

FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$', re.MULTILINE)
ROLLQ_PACKAGES = ("rollq", "rollq.protocol", "rollq.producer", "rollq.workers", "rollq.engine", "rollq.trainer")


@cache
def library_roots() -> tuple[str, ...]:
    """The folders whose code is not the user's: rollq's packages (its folders are mapped into the rollq package, so
    each has its own), the standard library and the installed packages."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    for name in ROLLQ_PACKAGES:
        spec = importlib.util.find_spec(name)  # its __init__.py's folder, without running the package
        if spec is not None and spec.origin:
            roots.add(os.path.dirname(spec.origin))
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


def is_user_path(path: str) -> bool:
    if path.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    real = os.path.realpath(path)
    return not any(real.startswith(root) for root in library_roots())


def innermost_user_frame(traceback_text: str) -> str:
    """`path:line, in function` of the innermost user frame of `traceback_text` (path relative to this folder when
    under it); '' when every frame is rollq's or a library's, or there is no traceback."""
    for match in reversed(list(FRAME.finditer(traceback_text))):
        path = match["path"]
        if is_user_path(path):
            try:
                shown = os.path.relpath(path) if os.path.realpath(path).startswith(os.getcwd() + os.sep) else path
            except ValueError:  # another drive (Windows)
                shown = path
            return f"{shown}:{match['line']}, in {match['func']}"
    return ""


__all__ = ["innermost_user_frame", "is_user_path", "library_roots"]
