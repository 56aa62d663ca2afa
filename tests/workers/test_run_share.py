"""RunShare: one worker process's concurrency shared by weight between the runs it serves, never idle while a run
has work (workers/run_share.py)."""

import asyncio

from rollq.workers.run_share import RunShare


def share_of(concurrency: int, weights: dict[str, float], running: dict[str, int]) -> tuple[RunShare, dict]:
    share = RunShare(concurrency, weights)
    wakes = {}
    for run in running:
        wakes[run] = asyncio.Event()
        share.join(run, lambda r=run: running[r], wakes[run])
    return share, wakes


def test_busy_runs_get_their_weighted_parts():
    running = {"a": 0, "b": 0}
    share, _ = share_of(8, {"a": 3.0}, running)  # b: weight 1
    assert share.free("a") == 6 and share.free("b") == 2
    running.update(a=6, b=2)
    assert share.free("a") == 0 and share.free("b") == 0


def test_an_idle_run_lends_its_part_and_takes_it_back_when_work_comes():
    running = {"a": 0, "b": 0}
    share, wakes = share_of(8, {}, running)
    share.wanting("b", False)  # b's read found nothing
    assert wakes["a"].is_set()  # a looks again: its cap grew
    assert share.free("a") == 8
    running["a"] = 8
    assert share.free("b") == 0  # nothing free in the process until a's jobs end
    share.wanting("b", True)
    running["a"] = 6  # two of a's jobs ended
    assert share.free("b") == 2 and share.free("a") == 0  # b's part (4) fills as slots free up; a is over its 4


def test_a_run_with_work_again_stops_the_borrower_at_its_part():
    """b lent its part while idle and a filled the process; b under its part claims (reads and holds) its work:
    from then on a starts nothing beyond its own part, and the slots its jobs free go to b."""
    running = {"a": 0, "b": 0}
    share, _ = share_of(8, {}, running)
    share.wanting("b", False)
    running["a"] = 8
    assert share.under_cap("b") and not share.under_cap("a")
    share.wanting("b", True)  # Worker._claim_share held b's entries
    running["a"] = 7  # one of a's jobs ended
    assert share.free("a") == 0 and share.free("b") == 1
