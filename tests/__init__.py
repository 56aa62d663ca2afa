"""rollq's test suite.

One torch thread per process, in the test processes and every process they start (trainers, reference engines):
set here, where the suite starts, before anything imports torch (its OpenMP runtime reads the setting once, when it
loads). The suite's models are tiny and CI runs four test processes, each with its subprocesses, on two cores: a
second intra-op thread only waits for its share of a small matrix, spinning while it waits, and that took about 15%
of the suite's CPU time (tests/trainer/test_families.py saw the same: 5-15x slower linear layers). The engines'
`torch_threads` default leaves one core to the event loop, 1 thread on CI's two cores anyway. A setting of your own
(`OMP_NUM_THREADS=4 pytest ...`) is kept.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
