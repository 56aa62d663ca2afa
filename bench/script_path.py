"""Imported first by a benchmark run as a script (`python bench/NAME.py`). Python then puts bench/ first on sys.path,
where `bench.common` is not importable and a bench module named like a stdlib one would shadow it: swap bench/ for
the repository root. (`python -m bench.NAME` needs none of this.)"""

import os
import sys

_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_BENCH), *(p for p in sys.path if os.path.abspath(p or os.curdir) != _BENCH)]
