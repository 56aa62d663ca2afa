"""A rank of a 2-rank trainer SIGKILLed mid-run: torchrun's elastic restart (`rollq train`, `max_restarts`) or
`rollq up`'s supervisor brings the group back, it resumes from the last checkpoint, and the independent auditor
shows every step trained once, no group trained twice and the staleness bound held."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, descendants, wait_until
from tests.trainer.helpers import WORKFLOW_KWARGS

STEPS, GROUP, GROUPS, ETA = 6, 4, 2, 1


def rank_pid(root: int, rank: int) -> int | None:
    """The process running trainer rank `rank` below `root` (torchrun sets RANK in each rank's environment)."""
    for pid in descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
    return None


def steps_done(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


async def kill_rank_after(proc: subprocess.Popen, metrics: Path, step: int, rank: int, log: Path) -> None:
    await wait_until(lambda: proc.poll() is not None or steps_done(metrics) >= step, 180, what=f"step {step}")
    assert proc.poll() is None, log.read_text()[-3000:]
    pid = await wait_until(lambda: rank_pid(proc.pid, rank), 30, what=f"rank {rank}'s process")
    os.kill(pid, signal.SIGKILL)  # wherever it is: collecting, training, publishing, checkpointing


def start(command: str, argv: list[str], log: Path) -> subprocess.Popen:
    """`rollq COMMAND ARGV` in a session of its own (the test kills what is left of it), output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rollq", command, *argv],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def run_killing(command: str, argv: list[str], log: Path, run_dir: Path, kills: list[tuple[int, int]]) -> str:
    """`rollq COMMAND ARGV`, SIGKILLing rank r once step k is done for each (k, r) of `kills`; it must then finish
    (exit 0). Returns its output."""
    proc = start(command, argv, log)
    try:
        for step, rank in kills:
            await kill_rank_after(proc, run_dir / "metrics.jsonl", step, rank, log)
        await wait_until(lambda: proc.poll() is not None, 300, what="the run to end")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert proc.returncode == 0, output[-4000:]
    return output


async def check_run(run_dir: Path, audit) -> None:
    await audit.check_run(run_dir / "metrics.jsonl", steps=STEPS, group_size=GROUP, groups_per_step=GROUPS, eta=ETA)
    samples = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    keys = [(s["job_id"], s["sample_index"]) for s in samples]
    assert len(keys) == len(set(keys)) == STEPS * GROUP * GROUPS  # the trained log, cut back at each restart


@pytest.mark.slow
@pytest.mark.scenario  # the chaos loop of CONTRIBUTING.md
async def test_torchrun_restarts_a_two_rank_trainer_whose_ranks_are_killed(
    redis_url, run_name, tmp_path, stack, auditor
):
    urls = await stack(run_name, engines=1, workers=2)
    audit = await auditor(run_name)
    run_dir = tmp_path / "run"
    config = tmp_path / "rollq.yaml"
    trainer = {
        "run_dir": str(run_dir),
        "engine": urls,
        "steps": STEPS,
        "nproc": 2,
        "max_restarts": 2,
        "trained_log": True,
        "group_size": GROUP,
        "groups_per_step": GROUPS,
        "max_staleness": ETA,
        "workflow_kwargs": WORKFLOW_KWARGS,
    }
    config.write_text(json.dumps({"redis_url": redis_url, "run": run_name, "trainer": trainer}))
    log = tmp_path / "trainer.log"
    # rank 1 (a follower) after step 2, then rank 0 (the rank that talks to Redis) after step 4
    output = await run_killing("train", ["--config", str(config)], log, run_dir, [(2, 1), (4, 0)])
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", output)]
    assert len(resumed) == 2 and resumed[0] >= 1 and resumed[1] >= 3, resumed
    await check_run(run_dir, audit)


@pytest.mark.slow
@pytest.mark.scenario  # the chaos loop of CONTRIBUTING.md
async def test_rollq_up_restarts_its_two_rank_trainer_when_a_rank_is_killed(redis_url, run_name, tmp_path, auditor):
    audit = await auditor(run_name)
    run_dir = tmp_path / "run"
    log = tmp_path / "up.log"
    argv = [
        *("--redis", redis_url, "--run", run_name, "--run-dir", str(run_dir)),
        *("--nproc", "2", "--max-restarts", "2", "--steps", str(STEPS), "--trained-log"),
        *("--group-size", str(GROUP), "--groups-per-step", str(GROUPS), "--max-staleness", str(ETA)),
    ]
    output = await run_killing("up", argv, log, run_dir, [(2, 1)])
    assert "starting it again (restart 1 of 2)" in output
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert len(re.findall(r"resumed at step (\d+)", trainer_log)) == 1
    await check_run(run_dir, audit)
