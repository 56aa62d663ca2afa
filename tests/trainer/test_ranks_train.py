"""`rollq train` on N ranks against a real stack: every step trained once, no group trained twice, the staleness
bound kept, as the independent auditor reads the run.

In CI: `rollq train --nproc 2` (it starts itself under torchrun) for 2 steps, its weights broadcast to the engines in
buckets gathered from both ranks' shards. A scenario (the chaos loop of CONTRIBUTING.md): 2 ranks on two "nodes"
(torchrun's multi-node rendezvous flags, one rank each), then resumed on 1 rank and on 2 again: too much CPU for
CI's 8 minutes, whose 2 -> 1 -> 2 coverage is at the policy level (tests/trainer/test_ranks.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollq.local import free_port
from rollq.trainer import checkpoint, samples
from tests.helpers import REPO_ROOT, wait_until
from tests.trainer.helpers import WORKFLOW_KWARGS

pytestmark = pytest.mark.slow

GROUP, GROUPS, ETA = 4, 2, 1


def train(config, log, *flags: str) -> str:
    with open(log, "a") as out:
        res = subprocess.run(
            [sys.executable, "-m", "rollq", "train", "--config", str(config), *flags],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    output = log.read_text()
    assert res.returncode == 0, output[-4000:]
    return output


def write_config(tmp_path, redis_url: str, run_name: str, urls: list[str], **settings) -> tuple:
    run_dir = tmp_path / "run"
    config = tmp_path / "rollq.yaml"
    trainer = {
        "run_dir": str(run_dir),
        "engine": urls,
        "max_restarts": 0,
        "group_size": GROUP,
        "groups_per_step": GROUPS,
        "max_staleness": ETA,
        "workflow_kwargs": WORKFLOW_KWARGS,
        **settings,
    }
    config.write_text(json.dumps({"redis_url": redis_url, "run": run_name, "trainer": trainer}))
    return run_dir, config


async def check_run(audit, run_dir, steps: int) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["version"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["trained_samples"] == steps * GROUP * GROUPS
    for r in records:
        assert r["staleness_max"] <= ETA and r["ledger_admitted"] <= r["ledger_limit"]
    trained = [g for r in records for g in r["groups"]]
    assert len(trained) == len(set(trained))
    await wait_until(lambda: audit.has(trained, GROUP), 20, what="the auditor to read every trained group")
    audit.check_trained(records, group_size=GROUP, eta=ETA)


async def test_rollq_train_nproc_2_trains_and_publishes_buckets_gathered_from_both_ranks(
    redis_url, run_name, tmp_path, stack, auditor
):
    urls = await stack(run_name, engines=1, workers=2)
    audit = await auditor(run_name)
    run_dir, config = write_config(tmp_path, redis_url, run_name, urls, steps=2)
    flags = ("--nproc", "2", "--weight-sync", "distributed", "--publish-bucket-mb", "0.25")
    output = train(config, tmp_path / "trainer.log", *flags)
    assert checkpoint.read_state(checkpoint.latest(run_dir)).ranks == 2, output[-2000:]
    await check_run(audit, run_dir, 2)
    # decoded samples written by rank 0 alone: each step's 4 once, said once in the output
    assert [r.step for r in samples.read(run_dir / samples.SAMPLES_FILE)] == [1] * 4 + [2] * 4
    assert output.count(f"decoded samples (4 of every step): {run_dir / samples.SAMPLES_FILE}") == 1


@pytest.mark.scenario
async def test_a_two_rank_trainer_resumes_on_one_rank_and_back_on_two(redis_url, run_name, tmp_path, stack, auditor):
    urls = await stack(run_name, engines=1, workers=2)
    audit = await auditor(run_name)
    run_dir, config = write_config(tmp_path, redis_url, run_name, urls, steps=2, nproc=2)
    log = tmp_path / "trainer.log"
    # two "nodes" of one rank each: torchrun's multi-node rendezvous flags, as on two machines
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"),
                *("--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
                *("--rdzv-id", run_name, "-m", "rollq", "train", "--config", str(config)),
            ],
            cwd=REPO_ROOT,
            stdout=open(tmp_path / f"node-{node}.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        for node in (0, 1)
    ]
    for node, proc in enumerate(nodes):
        assert proc.wait(300) == 0, (tmp_path / f"node-{node}.log").read_text()[-4000:]
    assert checkpoint.read_state(checkpoint.latest(run_dir)).ranks == 2
    output = train(config, log, "--nproc", "1", "--steps", "4")
    assert "resumed at step 2" in output and "checkpoint of 2 ranks resumed on 1" in output
    assert checkpoint.read_state(checkpoint.latest(run_dir)).ranks == 1
    # and the weights to the engines by broadcast, in buckets gathered from both ranks' shards
    output = train(config, log, "--steps", "6", "--weight-sync", "distributed", "--publish-bucket-mb", "0.25")
    assert "resumed at step 4" in output and "checkpoint of 1 ranks resumed on 2" in output

    await check_run(audit, run_dir, 6)
