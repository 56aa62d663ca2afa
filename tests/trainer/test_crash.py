"""`rollq train` SIGKILLed mid-run, twice, and restarted: it resumes from its checkpoint, trains every step once,
never trains a group twice, and keeps the staleness bound across the restarts."""

import json
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, wait_until
from tests.trainer.helpers import WORKFLOW_KWARGS

pytestmark = pytest.mark.slow

STEPS, GROUP, GROUPS, ETA = 7, 4, 2, 1


def start_trainer(config, log):
    out = open(log, "a")
    return subprocess.Popen(
        [sys.executable, "-m", "rollq", "train", "--config", str(config)],
        cwd=REPO_ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def steps_done(metrics) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


async def test_a_trainer_killed_twice_resumes_exactly(redis_url, run_name, tmp_path, stack, auditor):
    urls = await stack(run_name, engines=1, workers=2)
    audit = await auditor(run_name)
    run_dir = tmp_path / "run"
    config = tmp_path / "rollq.yaml"
    config.write_text(
        json.dumps(
            {  # YAML is a superset of JSON
                "redis_url": redis_url,
                "run": run_name,
                "trainer": {
                    "run_dir": str(run_dir),
                    "engine": urls,
                    "steps": STEPS,
                    "group_size": GROUP,
                    "groups_per_step": GROUPS,
                    "max_staleness": ETA,
                    "workflow_kwargs": WORKFLOW_KWARGS,
                },
            }
        )
    )
    log = tmp_path / "trainer.log"
    metrics = run_dir / "metrics.jsonl"
    for kill_after in (2, 4):
        trainer = start_trainer(config, log)
        await wait_until(
            lambda t=trainer, k=kill_after: t.poll() is not None or steps_done(metrics) >= k,
            120,
            what=f"step {kill_after}",
        )
        assert trainer.poll() is None, log.read_text()[-3000:]
        trainer.send_signal(signal.SIGKILL)  # wherever it is: training, loading weights, checkpointing, acking
        trainer.wait(10)
    trainer = start_trainer(config, log)
    trainer.wait(180)
    output = log.read_text()
    assert trainer.returncode == 0, output[-3000:]
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", output)]
    assert len(resumed) == 2 and resumed[0] >= 1 and resumed[1] >= 3, resumed

    await audit.check_run(metrics, steps=STEPS, group_size=GROUP, groups_per_step=GROUPS, eta=ETA)
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["steps"] == STEPS
