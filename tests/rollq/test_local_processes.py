"""rollq.local.Processes: children that die with their parent are started from the main thread only."""

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollq.local import LocalError, Processes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="die_with_parent is Linux's PR_SET_PDEATHSIG")
def test_a_child_that_dies_with_its_parent_is_not_started_from_another_thread(tmp_path):
    # Linux's "parent" is the thread that forked: an executor's thread ends at the loop's shutdown, and its children
    # got SIGTERM then (rollq up's Redis was started from one).
    with Processes(tmp_path, die_with_parent=True) as procs, ThreadPoolExecutor(1) as pool:
        started = pool.submit(procs.start, "child", [sys.executable, "-c", "pass"])
        with pytest.raises(LocalError, match="main thread only"):
            started.result(timeout=30)
        assert procs.started() == []
        proc = procs.start("child", [sys.executable, "-c", "pass"])  # the main thread's own: started
        assert proc.wait(30) == 0
