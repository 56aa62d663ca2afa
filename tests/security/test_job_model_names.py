"""The models a job may name (security round 2, N6): the built-in workflows loaded their `tokenizer` / `processor`
kwarg themselves, so a job could load any folder (`/etc`, `~root`, another tenant's), learn from the errors which
paths exist, and make the worker download from the Hugging Face Hub. Now every such name passes the worker's rule
(rollq.workers.model_names): rollq's built-in models, the worker's tokenizer or a folder under its models_root,
one refusal for everything else; and workers run with the Hub offline. A real Redis, real workers (in process and a
`rollq worker` subprocess) and a real loopback HTTP server standing for the Hub."""

from __future__ import annotations

import pytest
from aiohttp import web

from rollq.producer import Producer
from rollq.protocol.messages import Trajectory
from rollq.workers.model_names import ModelNames, job_model_dir, serving
from rollq.workers.resolver import WorkflowLoadError
from tests.helpers import running_worker

REWARD = {"reward_fn": "rollq.tasks.addition:addition_reward"}
TOOLS = {"tools": "tests.workers.test_builtin_workflows:ADD_TOOLS"}


def refusal(field: str, value: str) -> str:
    return (
        f"workflow kwarg {field!r}={value!r}: not a model this worker lets jobs name; a job may name tiny, smollm2, "
        "tiny-vl, the worker's own tokenizer, or a model folder relative to the worker's models_root (--models-root "
        "DIR)"
    )


@pytest.fixture
def models_root(tmp_path, tiny_dir):
    """A models_root holding one model folder (`tok`), a link out of it, and a tokenizer folder beside it."""
    root = tmp_path / "models"
    (root / "tok").mkdir(parents=True)
    (root / "link").symlink_to(tiny_dir)  # a tokenizer folder outside the root, through a link inside it
    (tmp_path / "outside").mkdir()
    return root


async def results(producer: Producer, jobs: dict[str, tuple[str, dict]], timeout_s: float) -> dict[str, Trajectory]:
    for job_id, (workflow, kwargs) in jobs.items():
        await producer.submit(workflow, {"prompt": "1+1"}, job_id=job_id, workflow_kwargs=kwargs)
    return {t.job_id: t async for t in producer.wait_for(dict.fromkeys(jobs, 1), timeout_s=timeout_s)}


async def test_every_model_name_a_job_may_not_use_gets_one_refusal(redis, redis_url, run_name, models_root, tiny_dir):
    refused = ["/etc", "~root", str(tiny_dir), "openai-community/gpt2", "../outside", "missing", "link", "tok/.."]
    jobs = {f"rlvr-{i}": ("rlvr", {**REWARD, "tokenizer": name}) for i, name in enumerate(refused)}
    # every built-in workflow: each loads its model by the name the job gives
    jobs["multi_turn"] = ("multi_turn", {**REWARD, "tokenizer": "/etc"})
    jobs["tool_agent"] = ("tool_agent", {**TOOLS, "tokenizer": "/etc"})
    jobs["vision_rlvr"] = ("vision_rlvr", {**REWARD, "processor": "/etc"})
    async with running_worker(redis_url, run_name, models_root=str(models_root), max_attempts=2):
        got = await results(Producer(redis, run_name), jobs, timeout_s=60)
    for job_id, (_, kwargs) in jobs.items():
        field = "processor" if "processor" in kwargs else "tokenizer"
        traj = got[job_id]
        assert traj.status == "error" and traj.error is not None, (job_id, traj)
        # the same words whatever is on disk (no oracle), refused as the workflow is built: never retried
        assert (traj.error.type, traj.error.message) == ("WorkflowLoadError", refusal(field, kwargs[field])), job_id
        assert traj.error.attempt == 1, job_id


def test_what_a_job_may_name_still_resolves(models_root, tiny_dir):
    models = ModelNames(worker_tokenizer=str(tiny_dir), models_root=str(models_root))
    with serving(models):
        assert job_model_dir("tok") == models_root / "tok"
        assert job_model_dir(str(tiny_dir)) == tiny_dir  # the worker's own tokenizer: the operator's choice
        assert job_model_dir("tiny") == tiny_dir
        with pytest.raises(WorkflowLoadError, match="not a model this worker lets jobs name"):
            job_model_dir("/etc")
    assert job_model_dir(str(tiny_dir)) == tiny_dir  # outside a worker (a script, the trainer): any directory


@pytest.fixture
async def hub():
    """A loopback HTTP server standing for the Hub (HF_ENDPOINT): what it was asked, if anything."""
    asked: list[str] = []

    async def record(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", asked
    await runner.cleanup()


async def test_a_worker_process_keeps_the_hub_offline(redis, redis_url, run_name, spawn_worker, hub):
    """`rollq worker` sets HF_HUB_OFFLINE=1 for itself (as huggingface_hub reads it) and its children, so a Hub id
    never becomes a download; the Hub id itself is refused before anything loads."""
    endpoint, asked = hub
    worker = spawn_worker(redis_url, run_name, env={"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0"})
    jobs = {
        "offline": ("tests.workflows:HubOffline", {}),
        "hub": ("rlvr", {**REWARD, "tokenizer": "openai-community/gpt2"}),
    }
    got = await results(Producer(redis, run_name), jobs, timeout_s=60)
    assert got["offline"].status == "ok" and got["offline"].sequences[0].reward == 1.0, worker.output()
    assert got["hub"].error is not None and got["hub"].error.message == refusal("tokenizer", "openai-community/gpt2")
    assert asked == []  # its handler runs on this loop: a request made before the results came is recorded
