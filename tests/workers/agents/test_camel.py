"""CAMEL-AI with the real camel-ai wheel (pinned, in its own cached site: its pins clash with ours): the docs'
example agent, examples/camel_agent.py, runs unchanged in `rollq worker` (a subprocess with the site first on its
path, since the site's mcp 1.x shadows the venv's mcp 2) against a scripted engine served from this process, over
real Redis streams. One worker serves both conversations: a single `astep`, and two `astep`s in one ChatAgent."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from rollq.producer.producer import JobRequest
from rollq.protocol.messages import Sequence
from tests.areal_real import submit_all
from tests.helpers import REPO_ROOT
from tests.scripted import scripted_engine, tiny_tokenizer
from tests.third_party import site

# camel-ai installed --no-deps, with what its import needs that the venv lacks or has in a version CAMEL can't use
# (mcp 2 removed mcp.server.FastMCP); everything else (pydantic, openai, httpx, tiktoken...) is the venv's own.
CAMEL_SITE = [
    "camel-ai==0.2.90",
    "mcp==1.30.0",
    "colorama==0.4.6",
    "httpx-sse==0.4.3",
    "pydantic-settings==2.16.3",
    "python-dotenv==1.2.4",
]
EXAMPLE = REPO_ROOT / "examples" / "camel_agent.py"
WORKFLOW = "camel_agent:CamelAgent"
QUESTION = {"question": "What is 2 + 3?", "answer": "5"}
# The scripted engine's reply to a conversation's first and second assistant turn: right, then wrong.
REPLIES = ["The answer is 5.", "On second thought, the answer is 6."]


def trained_text(seq: Sequence) -> str:
    ids = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    return tiny_tokenizer().decode(ids, skip_special_tokens=True)


async def run_camel(redis: Any, redis_url: str, run_name: str, spawn_worker: Any, jobs: list[JobRequest]):
    """The jobs' trajectories, by job id (bounded: 90 s), from one `rollq worker` subprocess that imports CAMEL."""
    path = os.pathsep.join(str(p) for p in (site("camel", CAMEL_SITE), EXAMPLE.parent))
    async with scripted_engine(REPLIES) as engine:
        worker = spawn_worker(
            redis_url,
            run_name,
            "--engine",
            engine.url,
            "--allow",
            "camel_agent",
            "--tokenizer",
            "tiny",
            "--max-attempts",
            "1",
            env={"PYTHONPATH": path},
        )
        try:
            got = await submit_all(redis, run_name, jobs, timeout_s=90)
        except TimeoutError:
            raise AssertionError(f"no result from the worker; its log:\n{worker.output()[-4000:]}") from None
        return {job_id: trajs[0] for job_id, trajs in got.items()}


@pytest.mark.slow  # a worker subprocess that imports CAMEL (~2 s), and the site built once (pip, cached)
async def test_camel_chat_agent_single_and_two_step(redis, redis_url, run_name, spawn_worker):
    jobs = [
        JobRequest(workflow=WORKFLOW, job_id="single", data=QUESTION),
        JobRequest(workflow=WORKFLOW, job_id="two", data=QUESTION, workflow_kwargs={"steps": 2}),
    ]
    got = await run_camel(redis, redis_url, run_name, spawn_worker, jobs)
    assert {k: t.status for k, t in got.items()} == {"single": "ok", "two": "ok"}, {k: t.error for k, t in got.items()}

    [seq] = got["single"].sequences
    assert trained_text(seq) == "The answer is 5." and seq.reward == 1.0
    assert len(seq.input_ids) == len(seq.loss_mask) == len(seq.logprobs) == len(seq.versions)

    # Individual export: a sequence per completion, each with its own reward ({response.info["id"]: reward}; with
    # the default turn_discount 1.0 the first adds the second's 0.0). A float return would give the first 0.0.
    first, second = got["two"].sequences
    assert trained_text(first) == "The answer is 5." and trained_text(second) == "On second thought, the answer is 6."
    assert (first.reward, second.reward) == (1.0, 0.0)
    # token in, token out: CAMEL's memory re-sends the history, and the second turn continues the first's exact ids
    assert list(second.input_ids[: len(first.input_ids)]) == list(first.input_ids)
    assert len(second.input_ids) > len(first.input_ids)


def _code_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_docs_show_the_example_as_it_is():
    """Every code block of docs/agents.md's CAMEL-AI section is a run of lines of examples/camel_agent.py (the file
    the test above runs), indentation aside: the docs can't drift from what is tested."""
    docs = (REPO_ROOT / "docs" / "agents.md").read_text()
    section = docs.split("\n## CAMEL-AI\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```[a-z]*\n(.*?)```", section, flags=re.S)
    assert blocks, "the CAMEL-AI section shows the example's code"
    example = _code_lines(Path(EXAMPLE).read_text())
    for block in blocks:
        lines = _code_lines(block)
        starts = [i for i in range(len(example)) if example[i : i + len(lines)] == lines]
        assert starts, f"not in {EXAMPLE.name} as written:\n{block}"
