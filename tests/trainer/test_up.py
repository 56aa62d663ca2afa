"""`rollq` on a fresh machine: the embedded default run starts its own Redis, a reference engine, a worker and the
trainer, shows progress, visibly learns the toy task, writes its run directory and stops everything it started."""

import json
import re
import signal
import statistics
import subprocess
import sys

import pytest

from rollq.local import redis_pings
from tests.helpers import REPO_ROOT, env_without_settings

STEPS = 30


def run_rollq(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "rollq", *args]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env_without_settings())


@pytest.mark.slow
def test_plain_rollq_trains_the_toy_task_and_cleans_up(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_rollq(f"steps={STEPS}", "lr=2e-3", f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == STEPS and summary["trained_samples"] == STEPS * 64
    assert re.search(rf"step +{STEPS}/{STEPS} +reward [0-9.]+ +accepted +{STEPS * 64}", proc.stderr)  # live lines

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last >= 0.1 and last >= 3 * first, rewards
    assert all(r["staleness_max"] <= 2 for r in records)
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "checkpoints" / "latest").exists()
    # what the model wrote, decoded: 4 samples of every step (the defaults), the file said once on the console
    # bytes' lines: a decoded completion may hold U+2028 or U+0085, which str.splitlines() takes for line ends
    lines = [json.loads(line) for line in (run_dir / "samples.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in lines] == [s for s in range(1, STEPS + 1) for _ in range(4)]
    assert all("Write a number using digits only." in r["prompt"] for r in lines)
    assert proc.stderr.count(f"decoded samples (4 of every step): {run_dir / 'samples.jsonl'}") == 1
    assert "torch.distributed is disabled" not in proc.stderr  # no torch warning among the step lines (F14)
    assert f"mean reward {summary['reward_first10']:.3f} (first 10 steps) -> " in proc.stderr

    # Everything it started is gone: its private Redis no longer answers.
    url = re.search(r"redis at redis://([^:]+):(\d+)/0", proc.stderr)
    assert url, proc.stderr[-2000:]
    if url.group(1) == "127.0.0.1":  # (a Redis on the default port, if this machine has one, is used instead)
        assert not redis_pings(int(url.group(2)))


@pytest.mark.slow
@pytest.mark.scenario  # 40 s: in CI it took .ci/run from 421 to 501 s, over its 8 minutes; CI keeps the pieces
def test_rollq_up_trains_the_visual_task_on_pictures(tmp_path):
    """The smoke version of the visual task's loop (CONTRIBUTING.md): `--model tiny-vl` brings toy:colours, and two
    steps train groups whose samples carry their pictures (none dropped as invalid: the trainer took the images)."""
    run_dir = tmp_path / "run"
    proc = run_rollq("up", "--model", "tiny-vl", "steps=2", f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["trained_samples"] == 2 * 32 and "invalid" not in summary["dropped"]
    assert "training toy:colours with the tiny-vl model" in proc.stderr
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and all(e["failed"] == 0 and e["samples"] == 20 for e in evals)


@pytest.mark.slow
def test_rollq_up_against_a_redis_that_does_not_answer_says_so(unused_redis_url, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "up", "--redis", unused_redis_url, f"run_dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"no Redis answers at {unused_redis_url}" in proc.stderr


def test_rollq_up_refuses_a_bad_setting_before_starting_anything(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "up", "steps=0", f"run_dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "steps: expected `int` >= 1" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.scenario  # the whole stack up, then SIGTERM: a loop of CONTRIBUTING.md
async def test_sigterm_stops_rollq_up_and_everything_it_started(tmp_path):
    from tests.helpers import wait_until

    log = tmp_path / "up.log"
    env = env_without_settings()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollq", "up", "steps=1000", f"run_dir={tmp_path / 'run'}"],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        await wait_until(
            lambda: proc.poll() is not None or "step    1/1000" in log.read_text(), 120, what="the first step"
        )
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 130 and "rollq up: stopped" in text, text[-2000:]
    url = re.search(r"redis at redis://([^:]+):(\d+)/0", text)
    if url.group(1) == "127.0.0.1":
        assert not redis_pings(int(url.group(2)))
    engine_log = (tmp_path / "run" / "logs" / "engine-0.log").read_text()
    assert "shutting down" in engine_log  # the engine was told to stop (SIGTERM), not orphaned


@pytest.mark.slow
async def test_an_engine_whose_steps_fail_is_an_error_line_on_the_console_of_rollq_up(tmp_path):
    """Issue 42: the engine's tracebacks sat only in runs/RUN/logs/engine-0.log while the console looked fine. The
    engine fails every real prompt for real (ROLLQ_ENGINE_FAULT=step_error:2, engine/server/faults.py: the one-token
    health probe still passes, as with a shared-prefix failure): its error is an ERROR line on the console, once, then
    a count at 10, 100, ... failures, never a line each; stopping the run sums up each child's errors."""
    from rollq.local import WaitTimeout
    from tests.helpers import wait_until

    run = tmp_path / "run"
    log, engine_log = tmp_path / "up.log", run / "logs" / "engine-0.log"
    failed = "engine step failed; aborting the running batch"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollq", "up", "steps=2", f"run_dir={run}"],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            # the engine stays in routing between failures (no 503 hold): 10 of them come in seconds, not minutes
            env={
                **env_without_settings(),
                "ROLLQ_ENGINE_FAULT": "step_error:2",
                "ROLLQ_ENGINE_UNHEALTHY_AFTER_ERRORS": "0",
            },
        )
    try:

        def engine_failed_10_times() -> bool:
            return proc.poll() is not None or (engine_log.exists() and engine_log.read_text().count(failed) >= 10)

        await wait_until(engine_failed_10_times, 240, what="the engine's first 10 failed steps")
        try:  # the console catches up within a poll or two (0.5 s each)
            await wait_until(lambda: "came 10 times so far" in log.read_text(), 10, what="the count on the console")
        except WaitTimeout:
            pass  # (8676c82: no such line; the assertions below say what is missing)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    failures = engine_log.read_text().count(failed)
    assert proc.returncode == 130 and failures >= 10, text[-3000:]
    shown = [line for line in text.splitlines() if failed in line]
    first = [line for line in shown if f" ERROR rollq.up: engine-0: {failed}: " in line]
    assert len(first) == 1, text[-3000:]
    assert "InjectedStepError: injected step failure (fault step_error:2)" in first[0]
    assert first[0].endswith(f"(rollq.engine; {engine_log})")
    assert any("came 10 times so far" in line for line in shown), text[-3000:]
    assert len(shown) <= 1 + len(str(failures))  # the first, then 10, 100, ...: never a line per failure
    summary = rf" ERROR rollq.up: engine-0 logged \d+ ERROR lines \(\d+ distinct\): {re.escape(str(engine_log))}"
    assert re.search(summary, text), text[-3000:]
