"""The `rollq` command as a user runs it: real subprocesses against a real redis-server."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, wait_registered, wait_until


def rollq(*args: str, timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollq", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )


def write_jobs(path: Path, count: int, **extra) -> Path:
    path.write_text("".join(json.dumps({"i": i, "job_id": f"line-{i}", **extra}) + "\n" for i in range(count)))
    return path


@pytest.mark.slow
async def test_enqueue_wait_returns_exactly_n_per_line_when_a_worker_is_sigkilled(
    redis, redis_url, run_name, spawn_worker, tmp_path
):
    markers = tmp_path / "markers"
    markers.mkdir()
    jobs = write_jobs(tmp_path / "jobs.jsonl", 12, sleep=0.3, marker_dir=str(markers))
    lease = ["--concurrency", "3", "--lease-ms", "1000"]
    workers = [spawn_worker(redis_url, run_name, *lease) for _ in range(2)]
    for w in workers:
        await wait_registered(redis, run_name, w.name)
    out = tmp_path / "out.jsonl"
    enqueue = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollq",
            "enqueue",
            str(jobs),
            "--workflow",
            "tests.workflows:Echo",
            "--n",
            "2",
            "--wait",
            "--output",
            str(out),
            "--timeout",
            "60",
            "--redis",
            redis_url,
            "--run",
            run_name,
        ],
        cwd=REPO_ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = workers[0]
    await wait_until(
        lambda: (
            any(markers.glob(f"start-*-{victim.proc.pid}")) and out.exists() and len(out.read_text().splitlines()) >= 4
        ),
        30,
        what="half-way",
    )
    victim.kill()
    _, err = await asyncio.to_thread(enqueue.communicate, timeout=90)
    assert enqueue.returncode == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["job_id"], r["sample_index"]) for r in records) == sorted(
        (f"line-{i}", s) for i in range(12) for s in range(2)
    )
    assert all(r["status"] == "ok" and r["error"] is None for r in records)
    assert {"job_id", "sample_index", "status", "sequences", "error", "worker_id"} <= set(records[0])
    assert records[0]["sequences"][0]["input_ids"][:2] == [100, 101]
    assert "24 ok, 0 rejected, 0 errors" in err
    # Running the same file again is a no-op: the job ids were submitted before.
    again = rollq(
        "enqueue", str(jobs), "--workflow", "tests.workflows:Echo", "--n", "2", "--redis", redis_url, "--run", run_name
    )
    assert again.returncode == 0 and "12 job ids were submitted before" in again.stderr


async def test_enqueue_wait_reports_a_malformed_job_and_completes_the_good_ones(
    redis, redis_url, run_name, spawn_worker, tmp_path
):
    worker = spawn_worker(redis_url, run_name, "--max-attempts", "1")
    await wait_registered(redis, run_name, worker.name)
    good = write_jobs(tmp_path / "good.jsonl", 3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"job_id": "x"}\n')
    res_bad = await asyncio.to_thread(
        rollq,
        "enqueue",
        str(bad),
        "--workflow",
        "tests.workflows:NoSuchClass",
        "--wait",
        "--timeout",
        "30",
        "--redis",
        redis_url,
        "--run",
        run_name,
    )
    res_good = await asyncio.to_thread(
        rollq,
        "enqueue",
        str(good),
        "--workflow",
        "tests.workflows:Echo",
        "--wait",
        "--timeout",
        "30",
        "--redis",
        redis_url,
        "--run",
        run_name,
    )
    assert res_good.returncode == 0 and len(res_good.stdout.splitlines()) == 3
    assert res_bad.returncode == 1
    [record] = [json.loads(line) for line in res_bad.stdout.splitlines()]
    assert record["status"] == "error"
    assert "has no attribute 'NoSuchClass'" in record["error"]["message"]
    status = json.loads(
        (await asyncio.to_thread(rollq, "status", "--json", "--redis", redis_url, "--run", run_name)).stdout
    )
    assert status["dead_letters"] == 1
    assert "NoSuchClass" in status["recent_dead_letters"][0]["message"]
    assert [w["name"] for w in status["workers"] if w["alive"]] == [worker.name]
    assert status["jobs"]["length"] == 0


def test_bad_input_file_is_rejected_with_the_line_and_nothing_is_submitted(tmp_path, redis_url, run_name, redis_server):
    f = tmp_path / "jobs.jsonl"
    f.write_text('{"i": 1}\n[1, 2]\n')
    res = rollq("enqueue", str(f), "--workflow", "m:C", "--redis", redis_url, "--run", run_name)
    assert res.returncode == 2
    assert f"{f}:2: expected a JSON object, got list" in res.stderr
    assert "Traceback" not in res.stderr
    res = rollq("enqueue", str(tmp_path / "missing.jsonl"), "--workflow", "m:C", "--redis", redis_url)
    assert res.returncode == 2 and "cannot read" in res.stderr


def test_a_line_cut_short_is_reported_at_its_column_by_enqueue_and_by_a_dataset(tmp_path, unused_redis_url):
    """The same column from `rollq enqueue` (a file's lines keep their newline) as from a trainer's dataset (F12)."""
    from rollq.producer.jsonl import JsonlError, json_objects
    from rollq.trainer.data import DatasetError, load_prompts

    line = '{"id": 3, "prompt": "What is 3 times 2?", "answer": "6"'  # no closing brace: the error is at its end
    f = tmp_path / "bad.jsonl"
    f.write_text('{"i": 1}\n' + line + "\n" + '{"i": 2}\n')
    want = f"{f}:2: not valid JSON (Expecting ',' delimiter at column {len(line) + 1})"
    res = rollq("enqueue", str(f), "--workflow", "m:C", "--redis", unused_redis_url)
    assert res.returncode == 2 and want in res.stderr, res.stderr
    with pytest.raises(DatasetError) as raised:
        load_prompts(str(f))
    assert want in str(raised.value)
    with pytest.raises(JsonlError, match=f"<stdin>:1: .* at column {len(line) + 1}"):  # a Windows line ending too
        list(json_objects([line + "\r\n"], "<stdin>"))


def test_every_command_says_in_one_line_when_redis_is_unreachable(unused_redis_url, tmp_path):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 1)
    for args in (["status"], ["enqueue", str(jobs), "--workflow", "m:C"], ["worker"]):
        res = rollq(*args, "--redis", unused_redis_url)
        assert res.returncode == 2, (args, res.stderr)
        # (a worker without agent_user first warns that its agents can write where it imports from)
        lines = [line for line in res.stderr.strip().splitlines() if "agent_user is unset" not in line]
        assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
        assert "cannot reach Redis" in lines[0] and "redis-server --port" in lines[0]


def test_redis_url_comes_from_the_environment(unused_redis_url):
    res = subprocess.run(
        [sys.executable, "-m", "rollq", "status"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={**__import__("os").environ, "ROLLQ_REDIS_URL": unused_redis_url},
    )
    assert res.returncode == 2 and unused_redis_url in res.stderr


def test_help_lists_the_commands():
    res = rollq("--help")
    assert res.returncode == 0
    for cmd in ("worker", "enqueue", "status"):
        assert cmd in res.stdout


async def test_enqueue_wait_on_a_partitioned_run_gets_every_partitions_results(
    redis, redis_url, run_name, tmp_path, spawn_worker
):
    worker = spawn_worker(redis_url, run_name)
    await wait_registered(redis, run_name, worker.name)
    jobs = write_jobs(tmp_path / "jobs.jsonl", 12)
    res = await asyncio.to_thread(
        rollq, "enqueue", str(jobs), "--workflow", "tests.workflows:Echo", "--n", "2", "--wait", "--timeout", "30",
        "--partitions", "3", "--redis", redis_url, "--run", run_name,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(records) == 24 and {r["status"] for r in records} == {"ok"}
    left = [k async for k in redis.scan_iter(match=f"rollq:{{{run_name}*}}:results:enqueue-*")]
    assert left == []  # every partition's private reply stream (and its counter) deleted at the end
