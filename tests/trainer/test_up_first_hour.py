"""`rollq up` as a new user meets it in the first hour (issue 44): watching it with `rollq status --run-dir`, Ctrl-C
(stops promptly, draws the plot), resuming with `rollq up --run-dir`, and a reward that raises (the failure's place
in the user's code, the worker's log, the dead letters kept in the run directory). Real processes throughout: the
whole tiny stack under `rollq up`."""

import json
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, env_without_settings, wait_until

STOP_BOUND_S = 60  # generous: only shows that it does not hang (it took ~15 s before, a few now)


def rollq(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "rollq", *args]
    return subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env_without_settings()
    )


def steps_recorded(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


SMALL = ["groups_per_step=2", "group_size=4", "eval_every=0"]

# `python ARGS` with SIGINT at its default first: a test run started in the background of a non-interactive shell
# (`.ci/run > log &`) inherits SIGINT ignored, and so would `rollq up`: Python then installs no Ctrl-C handler, the
# SIGINT below would do nothing, and the test would time out and SIGKILL it (the CI failure this was).
DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def user_reward(folder: Path, body: str) -> list[str]:
    """A reward function in the user's own module (`folder/my_rewards.py`, function `reward`): the settings that
    make `rollq up` use it."""
    signature = "def reward(prompt, completion, input_ids, output_ids, **data):"
    (folder / "my_rewards.py").write_text(f"import time\n\n\n{signature}\n    {body}\n")
    kwargs = 'workflow_kwargs={reward_fn: "my_rewards:reward", max_new_tokens: 4}'
    return ["--allow", "my_rewards", "--module-path", str(folder), kwargs]


@pytest.mark.slow
async def test_status_ctrl_c_and_resume_of_rollq_up(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "up.log"
    # Each sample spends a second in its reward: when Ctrl-C comes, the worker has jobs in flight to drain.
    slow = user_reward(tmp_path, "time.sleep(1.0)\n    return float(completion.strip().isdigit())")
    with open(log, "w") as out:
        argv = ["-m", "rollq", "up", *slow, "steps=1000", *SMALL, f"run_dir={run_dir}"]
        up = subprocess.Popen(
            [sys.executable, "-c", DEFAULT_SIGINT, *argv],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env_without_settings(),
        )
    try:
        await wait_until(lambda: up.poll() is not None or len(steps_recorded(run_dir)) >= 2, 240, what="2 steps")
        assert up.poll() is None, log.read_text()[-3000:]
        text = log.read_text()
        assert f"rollq status --run-dir {run_dir}" in text  # the ready command, printed at start
        record = run_dir / "up.json"
        assert stat.S_IMODE(record.stat().st_mode) == 0o600
        url = json.loads(record.read_text())["redis_url"]
        password = re.fullmatch(r"redis://:([^@]+)@127\.0\.0\.1:\d+/0", url)
        assert password, url  # the private Redis: its password is in the file...
        assert password.group(1) not in text  # ... and not on the console

        status = rollq("status", "--run-dir", str(run_dir), "--json", timeout=60)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["run"] == json.loads(record.read_text())["run"]

        up.send_signal(signal.SIGINT)  # the `up` process alone, as `kill -INT PID` does (not its group)
        # A SIGTERM while the worker drains (a second `kill`, `docker stop`): the way out goes on in order. (Before,
        # it cut the wind-down short: everything got SIGTERM at once, Redis went under the draining worker.)
        drain = run_dir / "logs" / "worker-0.log"
        await wait_until(lambda: "SIGTERM received: stopping" in drain.read_text(), 60, what="the worker's drain")
        up.send_signal(signal.SIGTERM)
        up.wait(STOP_BOUND_S)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
    text = log.read_text()
    assert up.returncode == 130, text[-3000:]
    assert "rollq up: stopped" in text and f"`rollq up --run-dir {run_dir}` resumes" in text
    worker_log = (run_dir / "logs" / "worker-0.log").read_text()
    # The worker drained while Redis still answered and stopped by itself (before: Redis went first, and the worker
    # rode out the "outage", logging "engine registry unavailable" each second, until it was killed), on one SIGTERM.
    assert "engine registry unavailable" not in worker_log and re.search(r"worker \S+ stopped: ", worker_log)
    assert "handing back running jobs now" not in worker_log, worker_log[-3000:]
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn for the interrupted run
    assert json.loads((run_dir / "up.json").read_text()).get("redis_url") is None  # its Redis is gone
    gone = rollq("status", "--run-dir", str(run_dir), timeout=60)
    assert gone.returncode == 2 and "is not running (it has exited" in gone.stderr, gone.stderr

    # Resume: the same run, from its checkpoint, with nothing that reads like data loss.
    before = steps_recorded(run_dir)
    done = before[-1]["step"]
    again = rollq("up", "--run-dir", str(run_dir), *slow, f"steps={done + 1}", *SMALL)  # flags before KEY=VALUEs
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed at step {done} " in again.stderr
    assert "WARNING" not in "".join(
        line for line in again.stderr.splitlines(keepends=True) if "rollq.trainer" in line
    ), again.stderr
    after = steps_recorded(run_dir)
    assert [r["step"] for r in after] == list(range(1, done + 2))
    # elapsed_s goes on from the checkpoint's, not from 0: the resumed step's includes all of the steps before it
    assert after[-1]["elapsed_s"] >= before[-1]["elapsed_s"] + after[-1]["step_s"] - 1e-6, after


@pytest.mark.slow
async def test_a_reward_that_raises_says_where_and_keeps_its_dead_letters(tmp_path):
    module = tmp_path / "my_rewards.py"
    run_dir = tmp_path / "run"
    proc = rollq("up", *user_reward(tmp_path, "return 1 / 0"), "steps=2", *SMALL, f"run_dir={run_dir}")
    assert proc.returncode == 4, proc.stderr[-3000:]
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("rollq up: the first"))
    assert f"ZeroDivisionError: division by zero (at {module}:5, in reward)" in line
    assert f"its traceback: {run_dir / 'logs' / 'worker-0.log'}" in line
    dead = run_dir / "dead-letters.jsonl"
    assert f"every failed job with its traceback: {dead}" in line
    assert stat.S_IMODE(dead.stat().st_mode) == 0o600
    letters = [json.loads(x) for x in dead.read_text().splitlines()]
    assert letters and all(f'File "{module}", line 5, in reward' in x["error"]["traceback"] for x in letters)
