"""AsyncRewardWrapper against real child processes: results, parallelism, timeouts, crashes, bad return values."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from rollq.workers.rewards.processes import AsyncRewardWrapper, RewardError, RewardNotANumber, RewardTimeout
from tests import reward_fns
from tests.helpers import pid_alive


@pytest.fixture
async def wrapper():
    async with AsyncRewardWrapper(reward_fns.dispatch, timeout_seconds=1.0, max_workers=4, max_retries=0) as w:
        yield w


async def test_returns_the_reward_as_float(wrapper):
    assert await wrapper("exact_match", "42") == 1.0
    assert await wrapper("exact_match", "41") == 0.0
    result = await wrapper("returns", 3)
    assert result == 3.0 and type(result) is float


async def test_kwargs_cross_the_process_boundary():
    async with AsyncRewardWrapper(reward_fns.exact_match, timeout_seconds=5.0) as w:
        assert await w(" 7 ", target="7") == 1.0


async def test_runs_in_another_process_and_reuses_it(wrapper):
    first = int(await wrapper("pid_of_worker"))
    second = int(await wrapper("pid_of_worker"))
    assert first != os.getpid()
    assert first == second  # sequential calls reuse the one warm child
    assert wrapper.pids == [first]


async def test_calls_up_to_max_workers_run_in_parallel(wrapper):
    await asyncio.gather(*(wrapper("sleepy", 0.0) for _ in range(4)))  # warm all four children
    start = time.monotonic()
    results = await asyncio.gather(*(wrapper("sleepy", 0.5, float(i)) for i in range(4)))
    elapsed = time.monotonic() - start
    assert results == [0.0, 1.0, 2.0, 3.0]
    assert elapsed < 1.5, f"4 x 0.5 s calls took {elapsed:.2f}s; not parallel"
    assert len(wrapper.pids) == 4


async def test_calls_beyond_max_workers_wait_for_a_free_worker():
    async with AsyncRewardWrapper(reward_fns.sleepy, timeout_seconds=1.0, max_workers=2) as w:
        # 4 calls of 0.4 s on 2 workers: two rounds; none times out since the timeout starts once a worker has it.
        results = await asyncio.gather(*(w(0.4) for _ in range(4)))
        assert results == [1.0] * 4
        assert len(w.pids) == 2


async def test_hung_reward_times_out_and_its_process_is_killed(wrapper, tmp_path):
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(RewardTimeout, match="longer than 1s"):
        await wrapper("record_pid_then_hang", str(pid_file))
    elapsed = time.monotonic() - start
    assert 0.9 < elapsed < 3.0
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert pid not in wrapper.pids
    assert await wrapper("exact_match", "42") == 1.0  # a fresh child takes over


async def test_reward_exception_becomes_reward_error(wrapper):
    with pytest.raises(RewardError, match="ValueError: bad answer format") as info:
        await wrapper("raises", "bad answer format")
    assert "raise ValueError(message)" in info.value.remote_traceback
    pids = wrapper.pids
    assert await wrapper("exact_match", "42") == 1.0
    assert wrapper.pids == pids  # an exception in user code doesn't cost the child


@pytest.mark.parametrize(
    "value, shown",
    [("abc", "str 'abc'"), (True, "bool True"), (None, "NoneType None"), (float("nan"), "float nan")],
)
async def test_non_number_result_is_rejected(wrapper, value, shown):
    with pytest.raises(RewardNotANumber, match=shown):
        await wrapper("returns", value)


async def test_crashing_process_gives_reward_error_and_is_replaced(wrapper):
    dead = int(await wrapper("pid_of_worker"))
    with pytest.raises(RewardError, match="exit code 3"):
        await wrapper("hard_exit", 3)
    assert not pid_alive(dead)
    assert await wrapper("exact_match", "42") == 1.0
    assert dead not in wrapper.pids


async def test_unpicklable_argument_is_a_reward_error_and_keeps_the_worker(wrapper):
    pids = [int(await wrapper("pid_of_worker"))]
    with pytest.raises(RewardError, match="could not be sent"):
        await wrapper("returns", lambda: 1)
    assert wrapper.pids == pids
    assert await wrapper("exact_match", "42") == 1.0


async def test_cancelled_call_kills_its_worker(wrapper, tmp_path):
    pid_file = tmp_path / "pid"
    task = asyncio.create_task(wrapper("record_pid_then_hang", str(pid_file)))
    while not pid_file.exists() or not pid_file.read_text():
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not pid_alive(int(pid_file.read_text()))
    assert wrapper.pids == []


async def test_close_stops_every_child():
    w = AsyncRewardWrapper(reward_fns.sleepy, timeout_seconds=5.0, max_workers=2)
    await asyncio.gather(w(0.0), w(0.0))
    pids = w.pids
    assert len(pids) == 2
    await w.close()
    assert not any(pid_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        await w(0.0)


async def test_child_startup_does_not_count_against_the_timeout():
    # A cold child takes ~100-300 ms to boot; a 0.3 s reward must still fit in a 0.5 s timeout on the first call.
    async with AsyncRewardWrapper(reward_fns.sleepy, timeout_seconds=0.5, max_workers=2) as w:
        assert await asyncio.gather(w(0.3), w(0.3)) == [1.0, 1.0]


def test_unpicklable_function_is_rejected_up_front():
    with pytest.raises(TypeError, match="picklable module-level"):
        AsyncRewardWrapper(lambda answer: 1.0)


async def test_max_retries_defaults_to_areals():
    w = AsyncRewardWrapper(reward_fns.sleepy)
    assert (w.timeout_seconds, w.max_retries) == (15.0, 3)  # areal/api/reward_api.py's defaults
    await w.close()
