"""Built-in workflows against real engine servers and a real EnginePool: the reference engine with the tiny model,
and (for the tool agent, whose loop needs tool calls a random model will not write) an engine server whose backend
plays a script of outputs."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.backend import Backend, GenState, stop_check
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.engine.types import ModelRequest, SamplingParams
from rollq.workers.builtin import BUILTIN_WORKFLOWS, resolve_agent_name
from rollq.workers.builtin.multi_turn import MultiTurnWorkflow
from rollq.workers.builtin.rlvr import RLVRWorkflow
from rollq.workers.builtin.tool_agent import ToolAgentWorkflow
from rollq.workers.chat_template import encode, load_tokenizer
from rollq.workers.loader import WorkflowCache
from rollq.workers.tool_calls import ToolRegistry

VERSION = 7


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


async def _pool_on(backend: Backend):
    handle = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0, weight_version=str(VERSION)))
    pool = EnginePool(PoolConfig(urls=[handle.url], no_engine_timeout_s=5.0))
    await pool.start()
    return handle, pool


@pytest.fixture
async def ref_pool():
    handle, pool = await _pool_on(ReferenceBackend(ReferenceConfig(model="tiny")))
    yield pool
    await pool.close()
    await handle.close()


def zero_reward(prompt_text, completion_text, input_ids, output_ids, **data) -> float:
    return 0.0


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


async def greedy(pool: EnginePool, ids: list[int], n: int):
    return await pool.agenerate(ModelRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=n, temperature=0.0)))


def test_agent_names():
    assert resolve_agent_name("rlvr") == "rollq.workers.builtin.rlvr:RLVRWorkflow"
    assert set(BUILTIN_WORKFLOWS) == {"rlvr", "multi_turn", "tool_agent", "vision_rlvr"}
    with pytest.raises(ValueError, match="known: multi_turn, rlvr, tool_agent, vision_rlvr"):
        resolve_agent_name("nope")


async def test_rlvr_against_the_reference_engine(ref_pool, tok):
    seen = []

    async def reward(prompt_text, completion_text, input_ids, output_ids, **data):
        seen.append((prompt_text, completion_text, input_ids, output_ids, data))
        return 0.5

    wf = RLVRWorkflow(reward_fn=reward, max_new_tokens=12, temperature=0.0)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    traj = await wf.arun_episode(ref_pool, {"messages": messages, "group_id": "g1", "answer": "4"})
    prompt = encode(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    ids, n = traj["input_ids"], len(prompt)
    assert ids[:n] == prompt and 0 < len(ids) - n <= 12
    assert all(len(traj[k]) == len(ids) for k in ("loss_mask", "logprobs", "versions"))
    assert traj["loss_mask"] == [0] * n + [1] * (len(ids) - n)
    assert traj["versions"] == [-1] * n + [VERSION] * (len(ids) - n)
    assert traj["logprobs"][:n] == [0.0] * n and all(lp <= 0 for lp in traj["logprobs"][n:])
    assert traj["reward"] == 0.5
    replay = await greedy(ref_pool, prompt, 12)  # greedy: the engine gives the same tokens again
    assert ids[n:] == replay.output_tokens
    assert traj["logprobs"][n:] == pytest.approx(replay.output_logprobs, abs=1e-4)
    prompt_text, completion, r_in, r_out, data = seen[0]
    assert r_in == prompt and r_out == ids[n:] and data == {"messages": messages, "group_id": "g1", "answer": "4"}
    assert prompt_text.endswith("<|im_start|>assistant\n") and completion == tok.decode(r_out, skip_special_tokens=True)


async def test_rlvr_built_by_the_worker_loader_from_prompt_and_input_ids(ref_pool, tok):
    wf = WorkflowCache().get(
        resolve_agent_name("rlvr"),
        {"reward_fn": "tests.workers.test_builtin_workflows:zero_reward", "max_new_tokens": 4},
    )
    traj = await wf.arun_episode(ref_pool, {"prompt": "hello"})
    prompt = encode(
        tok, tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    )
    assert traj["input_ids"][: len(prompt)] == prompt and 0 < sum(traj["loss_mask"]) <= 4
    traj = await wf.arun_episode(ref_pool, {"input_ids": [5, 6, 7]})
    assert traj["input_ids"][:3] == [5, 6, 7] and traj["loss_mask"][:3] == [0, 0, 0] and traj["reward"] == 0.0


async def test_multi_turn_builds_one_sequence_from_verbatim_engine_outputs(ref_pool, tok):
    wf = MultiTurnWorkflow(
        reward_fn=zero_reward, max_new_tokens=10, temperature=0.0, max_turns=3, feedback="Try again."
    )
    traj = await wf.arun_episode(ref_pool, {"prompt": "What is 2 + 2?"})
    ids, mask = traj["input_ids"], traj["loss_mask"]
    segments = runs(mask)
    assert len(segments) == 3
    for start, end in segments:
        replay = await greedy(ref_pool, ids[:start], 10)
        assert ids[start:end] == replay.output_tokens  # each assistant turn is exactly what the engine generated
        assert traj["versions"][start:end] == [VERSION] * (end - start)
    for (_, end), (nxt, _) in itertools.pairwise(segments):
        between = tok.decode(ids[end:nxt])
        assert "<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n" in between
        assert traj["logprobs"][end:nxt] == [0.0] * (nxt - end) and traj["versions"][end:nxt] == [-1] * (nxt - end)


async def test_multi_turn_stops_once_the_reward_reaches_one(ref_pool):
    wf = MultiTurnWorkflow(reward_fn=lambda *a, **k: 1.0, max_new_tokens=6, temperature=0.0, max_turns=3)
    traj = await wf.arun_episode(ref_pool, {"prompt": "hi"})
    assert len(runs(traj["loss_mask"])) == 1 and traj["reward"] == 1.0


# --- tool agent on a scripted engine ---------------------------------------------------------------------------


class ScriptedBackend(Backend):
    """Plays `outputs` (one token list per /generate call) in order, then answers with end-of-turn only; honours
    max_new_tokens and eos like a model would. Records every prompt it was given."""

    def __init__(self, tok, outputs: list[str]) -> None:
        self.tok = tok
        self.model_path = "scripted"
        self.vocab_size = len(tok)
        self.context_length = 8192
        self.eos = tok.eos_token_id
        self.eos_token_ids = frozenset({self.eos})
        self.outputs = [encode(tok, text) + [self.eos] for text in outputs]
        self.prompts: list[list[int]] = []

    async def run(self, state: GenState) -> None:
        if state.rid.startswith("HEALTH_CHECK_"):  # the server's own health probes are not turns of the script
            script = [self.eos]
        else:
            self.prompts.append(list(state.input_ids))
            script = self.outputs.pop(0) if self.outputs else [self.eos]
        for t in script:
            state.output_ids.append(t)
            state.output_logprobs.append(-0.5)
            state.finish = stop_check(state, t, self.eos_token_ids)
            if state.finish is not None:
                return

    def encode(self, text: str) -> list[int]:
        return encode(self.tok, text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    async def pause(self, mode) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def load_weights(self, path: str) -> None:
        pass


def schema(name: str, **props: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": name,
            "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}},
        },
    }


def call(name: str, **args) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.fixture
async def scripted(tok):
    opened = []

    async def start(outputs: list[str]):
        backend = ScriptedBackend(tok, outputs)
        handle, pool = await _pool_on(backend)
        opened.append((handle, pool))
        return backend, pool

    yield start
    for handle, pool in opened:
        await pool.close()
        await handle.close()


def add(a: int, b: int) -> int:
    return a + b


ADD_TOOLS = [(schema("add", a="integer", b="integer"), add)]


async def test_tool_agent_calls_the_tool_and_masks_its_response(scripted, tok):
    calls = []

    def weather(city: str) -> dict:
        calls.append(city)
        return {"city": city, "temperature": 21}

    backend, pool = await scripted([f"Let me check. {call('weather', city='Paris')}", "It is 21 degrees."])
    wf = ToolAgentWorkflow(
        tools=ToolRegistry([(schema("weather", city="string"), weather)]),
        reward_fn=lambda p, c, i, o, **d: float("21" in c),
    )
    traj = await wf.arun_episode(pool, {"prompt": "Weather in Paris?"})
    assert calls == ["Paris"]
    ids, mask = traj["input_ids"], traj["loss_mask"]
    # The prompt carries the tool schemas; the engine saw exactly the sequence built so far on each turn.
    assert '"name": "weather"' in tok.decode(backend.prompts[0])
    segments = runs(mask)
    assert len(segments) == 2 and len(backend.prompts) == 2
    (s1, e1), (s2, e2) = segments
    assert backend.prompts[0] == ids[:s1] and backend.prompts[1] == ids[:s2]
    assert tok.decode(ids[s1:e1]) == f"Let me check. {call('weather', city='Paris')}<|im_end|>"
    assert tok.decode(ids[s2:e2]) == "It is 21 degrees.<|im_end|>" and e2 == len(ids)
    tool_part = tok.decode(ids[e1:s2])
    assert tool_part == (
        '\n<|im_start|>user\n<tool_response>\n{"city": "Paris", "temperature": 21}\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert traj["logprobs"][e1:s2] == [0.0] * (s2 - e1) and traj["versions"][e1:s2] == [-1] * (s2 - e1)
    assert traj["logprobs"][s1:e1] == [-0.5] * (e1 - s1) and traj["versions"][s1:e1] == [VERSION] * (e1 - s1)
    assert traj["reward"] == 1.0


async def test_tool_agent_from_import_path_runs_calls_concurrently_and_reports_bad_calls(scripted, tok):
    both = asyncio.Barrier(2)  # sequential calls would never pass the barrier

    async def slow_add(a: int, b: int) -> int:
        await asyncio.wait_for(both.wait(), 5)
        return a + b

    text = call("add", a=1, b=2) + call("add", a=3, b=4) + "<tool_call>{bad json</tool_call>" + call("nope")
    backend, pool = await scripted([text, "done"])
    wf = ToolAgentWorkflow(tools=ToolRegistry([(schema("add", a="integer", b="integer"), slow_add)]))
    traj = await wf.arun_episode(pool, {"prompt": "add"})
    (_, e1), (s2, _) = runs(traj["loss_mask"])
    tool_part = tok.decode(traj["input_ids"][e1:s2])
    responses = [p.split("\n</tool_response>")[0] for p in tool_part.split("<tool_response>\n")[1:]]
    assert responses[:3] == ["3", "7", "error: unknown tool 'nope'"]
    assert responses[3].startswith("error: tool call 2 is not valid JSON")
    assert traj["reward"] == 0.0

    wf = WorkflowCache().get(
        resolve_agent_name("tool_agent"), {"tools": "tests.workers.test_builtin_workflows:ADD_TOOLS"}
    )
    backend, pool = await scripted([call("add", a=20, b=22), "42"])
    traj = await wf.arun_episode(pool, {"messages": [{"role": "user", "content": "20 + 22?"}]})
    (_, e1), (s2, _) = runs(traj["loss_mask"])
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(traj["input_ids"][e1:s2])


async def test_tool_agent_truncates_tool_output_in_tokens(scripted, tok):
    long = " ".join(f"word{i}" for i in range(300))
    registry = ToolRegistry([(schema("dump"), lambda: long)])
    backend, pool = await scripted([call("dump"), "ok"])
    wf = ToolAgentWorkflow(tools=registry, max_tool_response_tokens=10, max_response_tokens=1000)
    traj = await wf.arun_episode(pool, {"prompt": "dump"})
    (_, e1), (s2, _) = runs(traj["loss_mask"])
    content = tok.decode(traj["input_ids"][e1:s2]).split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert long.startswith(content) and len(encode(tok, content)) == 10
    overhead = len(encode(tok, tok.decode(traj["input_ids"][e1:s2]).replace(content, "")))
    assert s2 - e1 <= overhead + 10 + 1


async def test_tool_agent_honours_max_turns(scripted):
    registry = ToolRegistry([(schema("add", a="integer", b="integer"), add)])
    backend, pool = await scripted([call("add", a=1, b=1)] * 5)
    wf = ToolAgentWorkflow(tools=registry, max_turns=2, max_response_tokens=1000)
    traj = await wf.arun_episode(pool, {"prompt": "loop"})
    assert len(runs(traj["loss_mask"])) == 2 and len(backend.prompts) == 2
    assert traj["loss_mask"][-1] == 1  # ends on the last assistant turn, no dangling tool response


async def test_tool_agent_honours_the_token_budget(scripted, tok):
    registry = ToolRegistry([(schema("add", a="integer", b="integer"), add)])
    first = call("add", a=1, b=1)
    n_first = len(encode(tok, first)) + 1
    # Budget: the first turn fits, the tool response would leave no room for another turn -> stop after it.
    backend, pool = await scripted([first, "never"])
    wf = ToolAgentWorkflow(tools=registry, max_response_tokens=n_first + 5)
    traj = await wf.arun_episode(pool, {"prompt": "p"})
    assert len(backend.prompts) == 1 and sum(traj["loss_mask"]) == n_first
    # A long second turn is cut by the engine at the budget left: assistant + tool tokens never exceed it.
    backend, pool = await scripted([first, "x " * 200])
    wf = ToolAgentWorkflow(tools=registry, max_response_tokens=n_first + 40)
    traj = await wf.arun_episode(pool, {"prompt": "p"})
    prompt_len = len(backend.prompts[0])
    assert len(backend.prompts) == 2 and len(traj["input_ids"]) - prompt_len == n_first + 40


# --- reward execution modes ------------------------------------------------------------------------------------


def _expected_completion_reward(traj, prompt_len: int, bonus: float) -> float:
    return float(len(traj["input_ids"]) - prompt_len) + bonus  # tests.reward_fns.completion_reward


async def test_rlvr_reward_mode_process_runs_the_reward_in_a_child(ref_pool, tok):
    wf = RLVRWorkflow(
        reward_fn="tests.reward_fns:completion_reward",
        max_new_tokens=5,
        temperature=0.0,
        reward_mode="process",
        reward_timeout=5.0,
        reward_workers=1,
    )
    try:
        # "prompt" is a data key and also the function's first parameter name: left out of the kwargs.
        traj = await wf.arun_episode(ref_pool, {"input_ids": [5, 6, 7], "prompt": "ignored", "bonus": 0.5})
        assert traj["reward"] == _expected_completion_reward(traj, 3, 0.5)
        assert len(wf.reward._runner.pids) == 1
    finally:
        await wf.aclose()


async def test_process_mode_timeout_raises_instead_of_a_zero_reward(ref_pool):
    from rollq.workers.rewards.processes import RewardTimeout

    wf = MultiTurnWorkflow(
        reward_fn="tests.reward_fns:hang_forever", max_new_tokens=2, reward_mode="process", reward_timeout=0.3
    )
    try:
        with pytest.raises(RewardTimeout, match="hang_forever took longer than 0.3s"):
            await wf.arun_episode(ref_pool, {"input_ids": [5, 6, 7]})
    finally:
        await wf.aclose()


async def test_rlvr_reward_mode_remote_uses_the_reward_worker(ref_pool, redis_url, run_name, tmp_path, monkeypatch):
    from tests.workers.test_remote_rewards import reward_worker

    monkeypatch.setenv("ROLLQ_REDIS_URL", redis_url)
    with reward_worker(redis_url, run_name, tmp_path / "reward-worker.log", "--timeout", "5"):
        wf = RLVRWorkflow(
            reward_fn="tests.reward_fns:completion_reward",
            max_new_tokens=5,
            temperature=0.0,
            reward_mode="remote",
            reward_run=run_name,
        )
        try:
            traj = await wf.arun_episode(ref_pool, {"input_ids": [5, 6, 7], "prompt": "ignored", "bonus": 0.25})
            assert traj["reward"] == _expected_completion_reward(traj, 3, 0.25)
        finally:
            await wf.aclose()


async def test_remote_rewards_default_to_the_workers_own_redis_and_run(ref_pool, redis_url, run_name, tmp_path):
    """Built in a worker (its workflow context), a remote reward without reward_run goes to the reward workers of
    the worker's run, in the worker's Redis (not ROLLQ_REDIS_URL, not run "default")."""
    from rollq.workers.context import ContextConfig, WorkflowContext
    from tests.workers.test_remote_rewards import reward_worker

    with reward_worker(redis_url, run_name, tmp_path / "reward-worker.log", "--timeout", "5"):
        async with WorkflowContext(ContextConfig(redis_url=redis_url, run=run_name)):
            wf = RLVRWorkflow(reward_fn="tests.reward_fns:completion_reward", max_new_tokens=5, reward_mode="remote")
            try:
                traj = await wf.arun_episode(ref_pool, {"input_ids": [5, 6, 7], "bonus": 0.25})
                assert traj["reward"] == _expected_completion_reward(traj, 3, 0.25)
            finally:
                await wf.aclose()


def test_reward_mode_is_checked_at_construction():
    with pytest.raises(ValueError, match="reward_mode 'nope' is not one of inline, process, remote"):
        RLVRWorkflow(reward_fn=zero_reward, reward_mode="nope")
    with pytest.raises(ValueError, match="reward_mode"):
        ToolAgentWorkflow(tools=[], reward_mode="nope")
    with pytest.raises(ValueError, match="import path or a module-level function"):
        RLVRWorkflow(reward_fn=lambda *a, **k: 0.0, reward_mode="remote")
    with pytest.raises(TypeError, match="picklable"):
        MultiTurnWorkflow(reward_fn=lambda *a, **k: 0.0, reward_mode="process")
