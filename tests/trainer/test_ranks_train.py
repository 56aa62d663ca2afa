"""`rollq train` as 2 ranks on two "nodes" (torchrun's multi-node rendezvous flags, one rank each), then resumed on 1
rank and on 2 again (`--nproc 2`: it starts itself under torchrun), against a real stack: every step trained once,
no group trained twice, the staleness bound kept across the changes, as the independent auditor reads the run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollq.local import free_port
from rollq.trainer import checkpoint
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


async def test_a_two_rank_trainer_resumes_on_one_rank_and_back_on_two(redis_url, run_name, tmp_path, stack, auditor):
    urls = await stack(run_name, engines=1, workers=2)
    audit = await auditor(run_name)
    run_dir = tmp_path / "run"
    config = tmp_path / "rollq.yaml"
    config.write_text(
        json.dumps(
            {
                "redis_url": redis_url,
                "run": run_name,
                "trainer": {
                    "run_dir": str(run_dir),
                    "engine": urls,
                    "steps": 2,
                    "nproc": 2,  # the first run is torchrun's: each rank reads nproc and does not launch again
                    "max_restarts": 0,
                    "group_size": GROUP,
                    "groups_per_step": GROUPS,
                    "max_staleness": ETA,
                    "workflow_kwargs": WORKFLOW_KWARGS,
                },
            }
        )
    )
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

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["version"] for r in records] == list(range(1, 7))
    assert records[-1]["trained_samples"] == 6 * GROUP * GROUPS
    for r in records:
        assert r["staleness_max"] <= ETA and r["ledger_admitted"] <= r["ledger_limit"]
    trained = [g for r in records for g in r["groups"]]
    assert len(trained) == len(set(trained))
    await wait_until(lambda: audit.has(trained, GROUP), 20, what="the auditor to read every trained group")
    audit.check_trained(records, group_size=GROUP, eta=ETA)
