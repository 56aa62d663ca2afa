"""AReaL's OpenAI-SDK, Agents-SDK and LangChain agent files, from the real areal 1.0.4 wheel, in a rollq worker:
areal/workflow/openai/math_agent.py (MathAgent, MultiTurnMathAgent, MathToolAgent) and
areal/workflow/langchain/math_agent.py (MathAgent, MathToolAgent), each
(b) as the user's copy with only its `from areal...` line changed to rollq.workers.api: one worker in this process
    for the module (a module-scoped event loop), so its reward processes import the user's files once;
(a) unchanged, imported from the real areal package: one `rollq worker` subprocess for the module (areal's import
    takes seconds), areal's cached site first on its path, against one scripted engine whose replies each test sets.
Against the scripted replies of the tiny model's tokenizer: the statuses, the rewards (AReaL's turn discount for the
earlier turns) and the tokens trained (loss_mask), which decode to the replies."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from rollq.local import RedisServer
from rollq.protocol.messages import AgentOptions
from tests.areal_real import ConvertedWorker, UnchangedWorker, areal_file, user_package
from tests.scripted import tiny_tokenizer

FILES = {"openai": "areal/workflow/openai/math_agent.py", "langchain": "areal/workflow/langchain/math_agent.py"}
ANSWER = "The answer is 5."
SINGLE = [ANSWER]
RETRY = ["The answer is 4.", ANSWER]  # wrong, then right
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'  # both files' add(a, b)
TOOL = [TOOL_CALL, ANSWER]
AGENT = AgentOptions(turn_discount=0.9)  # AReaL's rule: an earlier turn's reward = its own + 0.9 * the next's


@dataclass(frozen=True)
class Case:
    file: str  # a key of FILES
    cls: str
    replies: list[str]
    rewards: list[float]  # per completion, in order; each completion's trained text is its reply

    @property
    def id(self) -> str:
        return f"{self.file}-{self.cls}"


CASES = [
    Case("openai", "MathAgent", SINGLE, [1.0]),
    Case("openai", "MultiTurnMathAgent", RETRY, [0.9, 1.0]),  # {completion id: reward}: 0 then 1, discounted
    Case("openai", "MathToolAgent", TOOL, [0.9, 1.0]),  # the Agents SDK's Runner, Responses API, function tools
    Case("langchain", "MathAgent", SINGLE, [1.0]),
    Case("langchain", "MathToolAgent", TOOL, [0.9, 1.0]),  # create_agent's tool loop
]


def trained_text(seq: Any) -> str:
    ids = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    return tiny_tokenizer().decode(ids, skip_special_tokens=True)


def check(case: Case, trajs: list[Any]) -> None:
    [t] = trajs
    assert t.status == "ok", t.error
    assert [trained_text(s) for s in t.sequences] == case.replies
    assert [s.reward for s in t.sequences] == pytest.approx(case.rewards)
    for earlier, later in zip(t.sequences, t.sequences[1:], strict=False):  # a later turn continues the earlier
        assert list(later.input_ids[: len(earlier.input_ids)]) == list(earlier.input_ids)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def converted_worker(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[ConvertedWorker, Path]]:
    """Mode (b): the user's package of both files, converted (its folder), and one worker in this process for the
    module's tests (its reward processes import the user's files once, not once per test)."""
    root = Path(tmp_path_factory.mktemp("user"))
    package = user_package(root, f"user_{uuid.uuid4().hex[:8]}", {f"{k}_math_agent": f for k, f in FILES.items()})
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        async with ConvertedWorker(redis_server.url, [package]) as worker:
            yield worker, root / package


@pytest.mark.slow  # the first job's reward processes start and import the user's file (seconds)
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
async def test_with_only_the_imports_changed(case: Case, converted_worker: tuple[ConvertedWorker, Path]) -> None:
    """Mode (b): the user's copy, its one `from areal.api import AsyncRewardWrapper` line now rollq's."""
    worker, folder = converted_worker
    original = areal_file(FILES[case.file]).splitlines()
    copy = (folder / f"{case.file}_math_agent.py").read_text().splitlines()
    assert len(copy) == len(original)
    assert [(a, b) for a, b in zip(original, copy, strict=True) if a != b] == [
        ("from areal.api import AsyncRewardWrapper", "from rollq.workers.api import AsyncRewardWrapper")
    ]
    workflow = f"{folder.name}.{case.file}_math_agent:{case.cls}"
    check(case, await worker.run_job(case.replies, workflow, agent=AGENT))


@pytest.fixture(scope="module")
def areal_worker(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UnchangedWorker]:
    worker = UnchangedWorker(redis_server.url, Path(tmp_path_factory.mktemp("areal-agents")))
    yield worker
    worker.close()


@pytest.mark.slow  # the module's worker subprocess imports areal (seconds, once)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
async def test_unchanged_with_areal_importable(case: Case, redis: Any, areal_worker: UnchangedWorker) -> None:
    """Mode (a): the file as the wheel ships it, named by its module in the real areal package."""
    workflow = f"areal.workflow.{case.file}.math_agent:{case.cls}"
    check(case, await areal_worker.run_job(redis, case.replies, workflow, agent=AGENT))
