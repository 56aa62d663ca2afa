"""RemoteReward against a real `rollq reward-worker` subprocess and a real Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis as sync_redis

from rollq.local import Processes, wait_until, wait_until_sync
from rollq.protocol.keys import RunKeys
from rollq.workers.rewards.arq_codec import NotPlainData
from rollq.workers.rewards.processes import RewardError, RewardNotANumber, RewardTimeout
from rollq.workers.rewards.remote import NoRewardWorker, RemoteReward
from tests.helpers import REPO_ROOT

READY_TIMEOUT_S = 20.0


@contextmanager
def reward_worker(redis_url: str, run: str, log: Path, *args: str) -> Iterator[subprocess.Popen]:
    """`rollq reward-worker` as a subprocess, ready once arq has written its health-check key; SIGKILLed after."""
    cmd = [
        sys.executable,
        "-m",
        "rollq",
        "reward-worker",
        "--redis",
        redis_url,
        "--run",
        run,
        "--allow",
        "tests",
        "--module-path",
        str(REPO_ROOT),
        *args,
    ]
    with Processes(log.parent, cwd=REPO_ROOT) as procs, sync_redis.Redis.from_url(redis_url) as client:
        proc = procs.start(log.stem, cmd)
        ready = RunKeys(run).rewards + ":health-check"  # arq writes it once it polls
        wait_until_sync(lambda: proc.poll() is not None or client.exists(ready), READY_TIMEOUT_S, what="reward worker")
        procs.check(proc)
        try:
            yield proc
        finally:
            procs.kill(proc)


@pytest.fixture(scope="module")
def served_run(redis_server, tmp_path_factory) -> Iterator[str]:
    """One reward worker for the module (start-up costs about a second): 1 s reward timeout, 2 children."""
    run = f"rw{uuid.uuid4().hex[:8]}"
    log = tmp_path_factory.mktemp("reward-worker") / "worker.log"
    with reward_worker(redis_server.url, run, log, "--timeout", "1", "--max-workers", "2"):
        yield run


@pytest.fixture
def remote(redis_url, served_run):
    made: list[RemoteReward] = []

    def make(fn: str, **kw) -> RemoteReward:
        made.append(RemoteReward(fn, redis_url=redis_url, run=served_run, **{"timeout_seconds": 1.0, **kw}))
        return made[-1]

    yield make


async def test_returns_the_reward(remote):
    async with remote("tests.reward_fns:exact_match") as rr:
        assert await rr("42") == 1.0
        assert await rr(" 7 ", target="7") == 1.0
        assert await rr("41") == 0.0
    async with remote("tests.reward_fns.returns") as rr:  # module.function spelling too
        result = await rr(3)
        assert result == 3.0 and type(result) is float


async def test_a_workflow_shaped_call_round_trips(remote):
    """What RewardCaller sends in remote mode: texts, token id lists, and the job's data as keyword arguments."""
    data = {"bonus": 0.5, "meta": {"tags": ["a", None, 2.5, True], 7: b"\x00"}, "none": None}
    async with remote("tests.reward_fns:completion_reward") as rr:
        assert await rr("prompt", "completion", [1, 2, 3], [4, 5, 6, 7], **data) == 4.5


async def test_arguments_that_are_not_plain_data_fail_at_the_caller(remote, redis, served_run):
    import datetime

    async with remote("tests.reward_fns:exact_match") as rr:
        with pytest.raises(
            NotPlainData,
            match=r"remote reward call of tests.reward_fns:exact_match: kwargs\['when'\] is datetime.datetime, "
            "not plain data",
        ):
            await rr("42", when=datetime.datetime(2024, 1, 1))
        with pytest.raises(NotPlainData, match=r"args\[0\] is object, not plain data"):
            await rr(object())
        with pytest.raises(NotPlainData, match=r"remote reward call of .*can't serialize ints"):
            await rr("42", big=2**70)
    assert await redis.zcard(RunKeys(served_run).rewards) == 0  # refused before anything was enqueued


async def test_hung_reward_times_out_and_the_worker_keeps_serving(remote, tmp_path):
    pid_file = tmp_path / "pid"
    async with remote("tests.reward_fns:record_pid_then_hang") as rr:
        start = time.monotonic()
        with pytest.raises(RewardTimeout, match="longer than 1s; worker .* killed"):
            await rr(str(pid_file))
        assert time.monotonic() - start < 4.0
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    async with remote("tests.reward_fns:hang_forever") as rr:
        with pytest.raises(RewardTimeout, match="hang_forever took longer than 1s"):
            await rr()
    async with remote("tests.reward_fns:exact_match") as rr:
        assert await rr("42") == 1.0


async def test_not_a_number(remote):
    async with remote("tests.reward_fns:returns") as rr:
        with pytest.raises(RewardNotANumber, match="returned str 'nope', not a finite number"):
            await rr("nope")
        with pytest.raises(RewardNotANumber, match="returned bool"):
            await rr(True)


async def test_raising_reward_is_a_reward_error_with_the_remote_traceback(remote):
    async with remote("tests.reward_fns:raises") as rr:
        with pytest.raises(RewardError, match="raised ValueError: bad answer") as info:
            await rr("bad answer")
    assert "ValueError: bad answer" in info.value.remote_traceback


async def test_bad_import_path_is_a_clear_reward_error(remote):
    async with remote("tests.reward_fns:no_such_fn") as rr:
        with pytest.raises(
            RewardError, match="cannot load reward function 'tests.reward_fns:no_such_fn'.*no attribute"
        ):
            await rr()
    async with remote("no_such_module_xyz:fn") as rr:
        with pytest.raises(RewardError, match="cannot load reward function .*no_such_module_xyz"):
            await rr()
    with pytest.raises(Exception, match="not an import path"):
        remote("nodots")


async def test_no_reward_worker_is_a_timeout_that_says_so(redis_url, run_name, redis):
    async with RemoteReward(
        "tests.reward_fns:exact_match",
        redis_url=redis_url,
        run=run_name,
        timeout_seconds=1.0,
        pickup_timeout_seconds=0.3,
    ) as rr:
        start = time.monotonic()
        with pytest.raises(NoRewardWorker, match="no reward worker answered on queue .* within 0.3s") as info:
            await rr("42")
        assert time.monotonic() - start < 2.0
    assert isinstance(info.value, RewardTimeout)
    assert await redis.zcard(RunKeys(run_name).rewards) == 0  # withdrawn: a worker starting later won't run it


def test_unreachable_redis_is_one_line(unused_redis_url):
    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "reward-worker", "--redis", unused_redis_url],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "cannot reach Redis" in proc.stderr


def test_sigterm_stops_the_reward_worker(redis_url, run_name, tmp_path):
    with reward_worker(redis_url, run_name, tmp_path / "w.log") as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_a_reward_worker_exits_with_a_clear_message_when_redis_stays_away(run_name, tmp_path):
    from rollq.local import RedisServer

    server = RedisServer().start()
    log = tmp_path / "w.log"
    try:
        with reward_worker(server.url, run_name, log, "--redis-outage-s", "2") as proc:
            server.close()  # and never back
            t0 = time.monotonic()
            assert proc.wait(30) == 3, log.read_text()[-2000:]
            assert time.monotonic() - t0 < 20
    finally:
        server.close()
    last = log.read_text().strip().splitlines()[-1]
    assert "redis_outage_s" in last and "serving remote rewards" in last, last


async def test_a_reward_worker_rides_out_a_redis_restart(run_name, tmp_path):
    from rollq.local import RedisServer

    server = RedisServer(aof=True).start()
    try:
        with reward_worker(server.url, run_name, tmp_path / "w.log", "--redis-outage-s", "30") as proc:
            server.kill()
            log = tmp_path / "w.log"
            # the outage lasts until the worker noticed it
            await wait_until(lambda: proc.poll() is not None or "went away" in log.read_text(), 20, what="the outage")
            assert proc.poll() is None, log.read_text()[-2000:]
            server.start()  # same port, from its AOF
            async with RemoteReward("tests.reward_fns:exact_match", redis_url=server.url, run=run_name) as rr:
                assert await rr("42") == 1.0  # served by the same reward worker process
            assert proc.poll() is None, log.read_text()[-2000:]
    finally:
        server.close()
