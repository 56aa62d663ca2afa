"""What `rollq up` leaves in its run directory and the commands that read it (issue 44): RUN_DIR/up.json (run name,
and while it runs its Redis URL, mode 0600) for `rollq status --run-dir` and for resuming with `rollq up --run-dir`;
RUN_DIR/dead-letters.jsonl; `rollq plot RUN_DIR`; a failure's place in the user's code; the datasets checked before
anything starts. The whole stack's side (Ctrl-C, resume, a reward that raises): tests/trainer/test_up_first_hour.py."""

import importlib.util
import json
import os
import stat
import subprocess
import sys
import traceback
from pathlib import Path

import msgspec
import pytest

from rollq.dead_letter_file import write_dead_letters
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.protocol.messages import DeadLetter, ErrorRecord, Job
from rollq.trainer.config import TrainConfig
from rollq.trainer.metrics import StepRecord, TrainStats
from rollq.up import resumed_run
from rollq.up_record import UpRecord, describe_run_dir, read_record, write_record
from rollq.user_frame import innermost_user_frame
from tests.helpers import REPO_ROOT, env_without_settings


def rollq(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    env = env_without_settings()
    return subprocess.run(
        [sys.executable, "-m", "rollq", *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- RUN_DIR/up.json ------------------------------------------------------------------------------------------------


def test_the_record_is_written_with_mode_0600_whatever_the_umask_and_replaced_whole(tmp_path):
    old = os.umask(0)  # the widest: a file created with the default mode would be world-readable
    try:
        path = write_record(tmp_path, UpRecord(run="r1", redis_url="redis://:secret@127.0.0.1:1/0", pid=7))
        assert mode(path) == 0o600
        write_record(tmp_path, UpRecord(run="r1", pid=7))  # up has exited: the URL goes
    finally:
        os.umask(old)
    assert mode(path) == 0o600
    assert b"secret" not in path.read_bytes()
    assert read_record(tmp_path) == UpRecord(run="r1", pid=7)
    assert [p.name for p in tmp_path.iterdir()] == ["up.json"]  # no temporary file left beside it
    assert read_record(tmp_path / "elsewhere") is None


def test_describe_run_dir_names_what_is_there(tmp_path):
    assert describe_run_dir(tmp_path) == "nothing yet"
    (tmp_path / "metrics.jsonl").write_text("{}\n{}\n")
    (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker-0.log").write_text("")
    assert describe_run_dir(tmp_path) == (
        "metrics.jsonl (2 steps), checkpoints/ (latest step-00000002), logs/ (worker-0.log)"
    )


def test_up_resumes_the_run_its_run_dir_records(tmp_path):
    write_record(tmp_path, UpRecord(run="up-20260101-000000", pid=1))
    cfg, resuming = resumed_run(TrainConfig(run_dir=str(tmp_path)))
    assert resuming and cfg.run == "up-20260101-000000"
    with pytest.raises(ValueError, match="holds run 'up-20260101-000000'.*not 'other'"):
        resumed_run(TrainConfig(run_dir=str(tmp_path), run="other"))
    # a `rollq up` running there now (its URL recorded, its pid alive): not a second one on the same run
    write_record(tmp_path, UpRecord(run="up-20260101-000000", redis_url="redis://127.0.0.1:1/0", pid=os.getppid()))
    with pytest.raises(ValueError, match=r"is running run .* now: watch it with `rollq status --run-dir"):
        resumed_run(TrainConfig(run_dir=str(tmp_path)))
    fresh, resuming = resumed_run(TrainConfig(run_dir=str(tmp_path / "new")))
    assert not resuming and fresh.run == "default"


# -- rollq status --run-dir -----------------------------------------------------------------------------------------


def test_status_reads_the_redis_and_run_from_the_run_dir(tmp_path, redis_url, run_name):
    write_record(tmp_path, UpRecord(run=run_name, redis_url=redis_url, pid=os.getpid()))
    proc = rollq("status", "--run-dir", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["run"] == run_name


def test_status_says_what_the_run_dir_holds_when_no_up_runs_there(tmp_path, unused_redis_url):
    proc = rollq("status", "--run-dir", str(tmp_path))
    assert proc.returncode == 2
    assert f"{tmp_path} has no up.json: it is not the run directory of a `rollq up`" in proc.stderr

    (tmp_path / "metrics.jsonl").write_text("{}\n" * 3)
    write_record(tmp_path, UpRecord(run="r1", pid=1))  # what `up` leaves once it has exited
    proc = rollq("status", "--run-dir", str(tmp_path))
    assert proc.returncode == 2
    assert "the `rollq up` of run 'r1'" in proc.stderr and "is not running (it has exited" in proc.stderr
    assert "holds: metrics.jsonl (3 steps)" in proc.stderr and f"rollq up --run-dir {tmp_path}` resumes" in proc.stderr

    write_record(tmp_path, UpRecord(run="r1", redis_url=unused_redis_url, pid=1))  # `up` was killed: Redis gone too
    proc = rollq("status", "--run-dir", str(tmp_path))
    assert proc.returncode == 2 and "is not running (its Redis does not answer" in proc.stderr, proc.stderr
    assert "localhost:6379" not in proc.stderr  # not the advice for a default Redis


# -- dead letters ---------------------------------------------------------------------------------------------------


def _dead_letter(job_id: str) -> bytes:
    letter = DeadLetter(
        entry_id="1-0",
        error=ErrorRecord(type="ZeroDivisionError", message="division by zero", traceback="Traceback ...: 1 / 0"),
        job=Job(job_id=job_id, workflow="rlvr", data={"prompt": "2 + 2"}),
    )
    return Codec().encode(letter)


async def test_dead_letters_are_written_to_a_file_of_mode_0600(tmp_path, redis, run_name):
    path = tmp_path / "dead-letters.jsonl"
    assert await write_dead_letters(redis, run_name, path) == 0 and not path.exists()
    for i in range(3):
        await redis.xadd(RunKeys(run_name).at(0).dead, {PAYLOAD_FIELD: _dead_letter(f"j{i}")})
    assert await write_dead_letters(redis, run_name, path) == 3
    assert mode(path) == 0o600
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["job"]["job_id"] for r in lines] == ["j0", "j1", "j2"]
    assert lines[0]["error"]["traceback"] == "Traceback ...: 1 / 0"
    # a resumed run in a fresh Redis keeps the earlier lives' letters, which only the file holds
    assert await write_dead_letters(redis, run_name, path, after=True) == 3
    assert len(path.read_text().splitlines()) == 6


# -- where in the user's code ---------------------------------------------------------------------------------------


def test_the_innermost_user_frame_of_a_real_traceback(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text("def helper(x):\n    return 1 / x\n\n\ndef reward(x):\n    return helper(x)\n")
    spec = importlib.util.spec_from_file_location("my_rewards", module)
    assert spec is not None and spec.loader is not None
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    try:
        list(map(mine.reward, [0]))  # through a builtin, and called from here (a test: user code too)
    except ZeroDivisionError:
        text = traceback.format_exc()
    assert innermost_user_frame(text) == f"{module}:2, in helper"
    try:
        msgspec.json.decode(b"{")  # raised inside a library: no user frame below this test's
    except msgspec.DecodeError:
        text = traceback.format_exc()
    assert innermost_user_frame(text).startswith(f"{os.path.relpath(__file__)}:")  # relative: under this folder
    library_only = 'Traceback (most recent call last):\n  File "' + msgspec.__file__ + '", line 1, in f\nE: x\n'
    assert innermost_user_frame(library_only) == ""


# -- rollq plot -----------------------------------------------------------------------------------------------------


def _step(step: int) -> StepRecord:
    stats = TrainStats(loss=0.1, clip_fraction=0, capped_fraction=0, importance_mean=1, grad_norm=1, behav_prox_gap=0)
    figures = {"gen_tokens_per_s": 100, "samples_per_s": 10, "collect_s": 1, "train_s": 1, "step_s": 2}
    return StepRecord(
        step=step,
        version=step,
        reward_mean=0.1 * step,
        reward_max=1,
        reward_min=0,
        samples=8,
        trained_samples=8 * step,
        groups=[],
        dropped={},
        dropped_this_step={},
        staleness_mean=0.5,
        staleness_max=1,
        staleness_hist={"0": 8},
        trained_tokens=64,
        pause_s=0.01,
        weight_load_s=0.01,
        ledger_version=step,
        ledger_admitted=8,
        ledger_limit=24,
        elapsed_s=2.0 * step,
        time=1.0,
        train=stats,
        **figures,
    )


def test_rollq_plot_draws_a_run_dir_s_plot_from_its_metrics(tmp_path):
    proc = rollq("plot", str(tmp_path))
    assert proc.returncode == 2 and f"no {tmp_path / 'metrics.jsonl'}" in proc.stderr
    (tmp_path / "metrics.jsonl").write_bytes(b"".join(msgspec.json.encode(_step(i)) + b"\n" for i in (1, 2, 3)))
    proc = rollq("plot", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the datasets, before anything starts ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dataset", "eval_dataset"])
def test_a_bad_dataset_line_stops_up_before_anything_starts(tmp_path, which):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1 + 1", "answer": "2"}\n{"prompt": "2 + 2", "answer": 4\n')
    run_dir = tmp_path / "run"
    proc = rollq("up", f"{which}={bad}", f"run_dir={run_dir}", "--redis", "redis://127.0.0.1:1/0")
    assert proc.returncode == 2, proc.stderr
    assert f"rollq up: {bad}:2: not valid JSON" in proc.stderr
    # nothing was started: no run directory, no child's log, and the unanswering --redis was never tried
    assert not run_dir.exists() and "no Redis answers" not in proc.stderr
