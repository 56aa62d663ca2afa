"""What a worker says when a job's user module can't be used: a misspelt (allowed) module name says that no such
module is on the worker's module paths, naming them; a path the allowlist refuses says only that, whether its module
exists or not; an attribute added to a module after the worker imported it is missing until the worker restarts,
and the error says so."""

from __future__ import annotations

import textwrap

import pytest

from rollq.producer.producer import JobRequest, Producer
from rollq.trainer.config import TrainConfig
from rollq.up import UpConfig, worker_allowlist
from tests.helpers import REPO_ROOT, wait_registered

MY_AGENT = """
class MulAgent:
    async def arun_episode(self, engine, data):
        return None  # rejected: these tests only need the module imported
"""


async def errors_of(producer, consumer, workflows: dict[str, str]) -> dict[str, str]:
    """Submit one job per (job id, workflow); each job's error message (or its status)."""
    await producer.submit_many([JobRequest(workflow=w, job_id=j) for j, w in workflows.items()])
    trajs = [t async for t in producer.wait_for(dict.fromkeys(workflows, 1), timeout_s=60, consumer=consumer)]
    return {t.job_id: t.error.message if t.error else t.status for t in trajs}


@pytest.mark.slow
async def test_misspelt_refused_and_edited_modules_each_say_what_happened(
    redis, redis_url, run_name, spawn_worker, tmp_path
):
    modules = tmp_path / "mods"
    modules.mkdir()
    (modules / "my_agent.py").write_text(textwrap.dedent(MY_AGENT))
    # as `rollq up --allow my_agent workflow=my_agnt:MulAgent` starts its workers: the typo is allowed by name
    allow = worker_allowlist(TrainConfig(workflow="my_agnt:MulAgent"), UpConfig(allow=["my_agent"]))
    worker = spawn_worker(
        redis_url, run_name, *[a for p in allow for a in ("--allow", p)], "--module-path", str(modules)
    )
    await wait_registered(redis, run_name, worker.name)
    producer = Producer(redis, run_name)
    consumer = producer.consumer()
    await consumer.setup()
    errors = await errors_of(
        producer,
        consumer,
        {
            "typo": "my_agnt:MulAgent",
            "first-use": "my_agent:MulAgent",
            "refused-missing": "not_a_module_anywhere:Thing",
            "refused-existing": "json:dumps",
        },
    )
    typo = errors["typo"]
    assert "cannot import module 'my_agnt'" in typo and "not allowed" not in typo
    on_paths = f"on the module paths (its module paths: {REPO_ROOT}, {modules})"
    assert f"no module 'my_agnt' among the installed packages or {on_paths}" in typo
    assert errors["first-use"] == "rejected"  # my_agent is imported now
    # Refused before anything is imported: the message can't tell whether the module exists
    for job, path in (("refused-missing", "not_a_module_anywhere:Thing"), ("refused-existing", "json:dumps")):
        assert errors[job].startswith(f"import path {path!r} is not allowed here, so nothing was imported"), errors[job]
        assert "no module" not in errors[job] and "cannot import" not in errors[job]
    assert errors["refused-missing"].replace("not_a_module_anywhere:Thing", "X") == errors["refused-existing"].replace(
        "json:dumps", "X"
    )

    # The user adds a class to the module the worker has imported already
    (modules / "my_agent.py").write_text(textwrap.dedent(MY_AGENT) + "\n\nclass Later(MulAgent):\n    pass\n")
    [stale] = (await errors_of(producer, consumer, {"edited": "my_agent:Later"})).values()
    assert "module 'my_agent' has no attribute 'Later'" in stale
    assert "imported 'my_agent' when a job first used it" in stale and "only after the worker restarts" in stale
