"""Imported first by a benchmark run as a script (`python bench/NAME.py`). Python then puts bench/ first on sys.path,
where bench/queue.py would shadow the stdlib `queue` (asyncio imports it) and `bench.common` is not importable:
swap bench/ for the repository root. (`python -m bench.NAME` needs none of this.)"""

import os
import sys

_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_BENCH), *(p for p in sys.path if os.path.abspath(p or os.curdir) != _BENCH)]
