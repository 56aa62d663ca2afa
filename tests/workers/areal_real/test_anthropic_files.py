"""AReaL's Anthropic agent files, from the real areal 1.0.4 wheel, in a rollq worker:
- areal/workflow/anthropic/math_agent.py: `anthropic.AsyncAnthropic(base_url=extra_kwargs["base_url"],
  http_client=extra_kwargs["http_client"])`, one message;
- areal/workflow/anthropic/claude_math_agent.py: claude_agent_sdk, which runs its bundled `claude` CLI with
  ANTHROPIC_BASE_URL = `base_url`, and an in-process MCP calculator (a tool call, then the answer).
Both hand the one `base_url` AReaL's proxy gives agents to an Anthropic client, which appends /v1/messages: rollq's
`base_url` (<proxy>/v1) serves that too, and `http_client` is of the kind the installed anthropic takes (httpx2 for
anthropic>=1.0). The CLI's requests carry a `system` message among the messages (its per-turn instructions).
(b) the user's copy with only its `from areal...` line changed, in a worker in this process; (a) unchanged, imported
from the real areal package, in one `rollq worker` subprocess for the module with areal's cached site first on its
path. claude-agent-sdk (with the CLI) lives in a cached site of its own, never in the project's environment."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollq.local import RedisServer
from rollq.protocol.messages import AgentOptions
from rollq.workers.proxy.anthropic import normalize_messages
from tests.areal_real import UnchangedWorker, areal_file, run_converted, user_package
from tests.scripted import tiny_tokenizer
from tests.third_party import site

MATH_AGENT = "areal/workflow/anthropic/math_agent.py"
CLAUDE_AGENT = "areal/workflow/anthropic/claude_math_agent.py"
# claude-agent-sdk and what it needs that the project's environment lacks (mcp, and mcp's own).
CLAUDE_SITE = [
    "claude-agent-sdk==0.2.189",  # bundles the claude CLI 2.1.332
    "mcp==1.30.0",
    "httpx-sse==0.4.3",
    "pydantic-settings==2.16.3",
    "python-dotenv==1.2.4",
]
ANSWER = "The answer is 5."
TOOL_CALL = '<tool_call>\n{"name": "mcp__calc__add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
MATH = ([ANSWER], [1.0])
CLAUDE = ([TOOL_CALL, ANSWER], [0.9, 1.0])
MATH_KWARGS = {"max_tokens": 64}  # AReaL's MathAgent hands its kwargs to messages.create, which needs max_tokens
CLAUDE_KWARGS = {"max_turns": 4}
AGENT = AgentOptions(turn_discount=0.9)


def trained_text(seq: Any) -> str:
    ids = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    return tiny_tokenizer().decode(ids, skip_special_tokens=True)


def check(trajs: list[Any], replies: list[str], rewards: list[float]) -> None:
    [t] = trajs
    assert t.status == "ok", t.error
    assert [trained_text(s) for s in t.sequences] == replies
    assert [s.reward for s in t.sequences] == pytest.approx(rewards)
    for earlier, later in zip(t.sequences, t.sequences[1:], strict=False):  # the answer continues the tool call
        assert list(later.input_ids[: len(earlier.input_ids)]) == list(earlier.input_ids)


def converted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, rel: str) -> str:
    """The user's copy: only the `from areal.api import AsyncRewardWrapper` line differs."""
    package = user_package(tmp_path, f"user_{uuid.uuid4().hex[:8]}", {module: rel})
    original, copy = areal_file(rel).splitlines(), (tmp_path / package / f"{module}.py").read_text().splitlines()
    assert [(a, b) for a, b in zip(original, copy, strict=True) if a != b] == [
        ("from areal.api import AsyncRewardWrapper", "from rollq.workers.api import AsyncRewardWrapper")
    ]
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{package}.{module}"


def test_a_system_message_among_the_messages_stays_in_its_place():
    """The claude CLI (2.1.332) sends its environment block as a `system` message after the user's first one, text
    blocks with cache_control (its per-turn-control beta); the proxy refused it (400) and no completion was made."""
    body = {
        "system": [{"type": "text", "text": "Use the tools."}],
        "messages": [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "system", "content": [{"type": "text", "text": "env", "cache_control": {"type": "ephemeral"}}]},
        ],
    }
    assert normalize_messages(body) == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "system", "content": "env"},
    ]


@pytest.mark.slow  # math_verify's reward process starts (seconds)
async def test_math_agent_with_only_its_imports_changed(redis, redis_url, run_name, tmp_path, monkeypatch):
    module = converted(tmp_path, monkeypatch, "math_agent", MATH_AGENT)
    trajs = await run_converted(
        redis, redis_url, run_name, MATH[0], f"{module}:MathAgent", workflow_kwargs=MATH_KWARGS, agent=AGENT
    )
    check(trajs, *MATH)


@pytest.mark.slow  # the claude CLI starts, and math_verify's reward process (seconds)
async def test_claude_agent_with_only_its_imports_changed(redis, redis_url, run_name, tmp_path, monkeypatch):
    claude = site("claude", CLAUDE_SITE)
    monkeypatch.setattr(sys, "path", [*sys.path, str(claude)])  # after the venv's packages
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "claude"))  # the CLI's state, not the user's ~/.claude
    monkeypatch.delenv("CLAUDE_CODE_STREAM_CLOSE_TIMEOUT", raising=False)  # the agent sets it: put back after
    module = converted(tmp_path, monkeypatch, "claude_math_agent", CLAUDE_AGENT)
    trajs = await run_converted(
        redis, redis_url, run_name, CLAUDE[0], f"{module}:MathToolAgent", workflow_kwargs=CLAUDE_KWARGS, agent=AGENT
    )
    check(trajs, *CLAUDE)


@pytest.fixture(scope="module")
def areal_worker(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UnchangedWorker]:
    logs = Path(tmp_path_factory.mktemp("areal-anthropic"))
    with pytest.MonkeyPatch.context() as env:  # what the worker subprocess inherits
        env.setenv("CLAUDE_CONFIG_DIR", str(logs / "claude"))
        worker = UnchangedWorker(redis_server.url, logs, extra_path=(site("claude", CLAUDE_SITE),))
    yield worker
    worker.close()


@pytest.mark.slow  # the module's worker subprocess imports areal (seconds, once), then the claude CLI starts
async def test_both_files_unchanged_with_areal_importable(redis: Any, areal_worker: UnchangedWorker) -> None:
    """Mode (a): the files as the wheel ships them, named by their modules in the real areal package."""
    math = "areal.workflow.anthropic.math_agent:MathAgent"
    check(await areal_worker.run_job(redis, MATH[0], math, workflow_kwargs=MATH_KWARGS, agent=AGENT), *MATH)
    claude = "areal.workflow.anthropic.claude_math_agent:MathToolAgent"
    check(await areal_worker.run_job(redis, CLAUDE[0], claude, workflow_kwargs=CLAUDE_KWARGS, agent=AGENT), *CLAUDE)
