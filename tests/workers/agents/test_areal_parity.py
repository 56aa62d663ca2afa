"""AReaL parity: RolloutWorkflows in the shapes of AReaL's docs (tests/areal_agents.py: AReaL's API used as AReaL
uses it, with rollq's imports) run unchanged in a real rollq worker, against a real EnginePool and a scripted engine
server, over real Redis streams. Defaults and names as AReaL's: AgentOptions(mode, export_style, turn_discount).
AReaL's own agent files (math, multi-turn, the Agents SDK calculator) run from the real wheel in
tests/workers/areal_real/test_agent_files.py."""

from __future__ import annotations

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.types import GenerationHyperparameters, ModelRequest, ModelResponse
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.protocol.messages import AgentOptions, Job
from rollq.workers.context import WorkflowContext
from rollq.workers.outputs import WorkflowOutputError, to_sequences
from rollq.workers.rewards.processes import DEFAULT_MAX_WORKERS, AsyncRewardWrapper
from tests import reward_fns
from tests.helpers import pid_alive, running_worker
from tests.scripted import scripted_engine, tiny_tokenizer

QUESTION = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}


async def run(redis, redis_url, run_name, replies, workflow, n=1, jobs=None, job_id="j", **job_fields):
    """Submit `jobs` (default: one JobRequest of `workflow`) and return the trajectories, sorted."""
    async with scripted_engine(replies) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        async with running_worker(redis_url, run_name, engine=pool, max_attempts=1, concurrency=8):
            producer = Producer(redis, run_name)
            consumer = producer.consumer()
            await consumer.setup()
            if jobs is None:
                request = JobRequest(workflow=workflow, job_id=job_id, n=n, data=QUESTION, **job_fields)
                await producer.submit_many([request])
                expected = {job_id: n}
            else:  # raw jobs (fields the producer does not set, e.g. is_eval)
                codec = Codec()
                for job in jobs:
                    await redis.xadd(RunKeys(run_name).jobs, {PAYLOAD_FIELD: codec.encode(job)})
                expected = {j.job_id: j.n for j in jobs if j.sample_index == 0}
            got = [t async for t in producer.wait_for(expected, timeout_s=60, consumer=consumer)]
    return sorted(got, key=lambda t: (t.job_id, t.sample_index))


def trained_text(seq) -> str:
    ids = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    return tiny_tokenizer().decode(ids, skip_special_tokens=True)


def test_agent_options_take_areals_names_and_defaults():
    default = AgentOptions()
    assert (default.mode, default.export_style, default.turn_discount) == ("inline", "individual", 1.0)
    assert AgentOptions(export="concat") == AgentOptions(export_style="concat")  # rollq's earlier name
    with pytest.raises(ValueError, match="contradicts"):
        AgentOptions(export="individual", export_style="concat")


def test_generation_hyperparameters_as_areals():
    g = GenerationHyperparameters()
    assert (g.n_samples, g.max_new_tokens, g.max_tokens, g.top_k, g.greedy, g.stop_token_ids) == (
        1,
        16384,
        32768,
        int(1e8),
        False,
        [],
    )
    g2 = g.new(max_new_tokens=8, greedy=True).new_with_stop_and_pad_token_ids(tiny_tokenizer())
    assert g.max_new_tokens == 16384 and g2.max_new_tokens == 8 and g2.stop_token_ids == [0, 2]  # pad, eos
    req = ModelRequest(rid="r", input_ids=[1, 2, 3], gconfig=g2, tokenizer=tiny_tokenizer())
    assert (req.sampling.max_new_tokens, req.sampling.temperature, req.sampling.top_k) == (8, 0.0, -1)
    assert req.sampling.stop_token_ids == [0, 2]
    assert ModelRequest(input_ids=[1] * 30, gconfig=g.new(max_tokens=32)).sampling.max_new_tokens == 2
    with pytest.raises(ValueError, match="n_samples is 4"):
        ModelRequest(input_ids=[1], gconfig=g.new(n_samples=4))
    resp = ModelResponse(
        input_tokens=[1, 2], output_tokens=[3], output_logprobs=[-0.1], output_versions=[0], stop_reason="stop"
    )
    assert (resp.input_len, resp.output_len) == (2, 1)


def test_areal_output_shapes():
    torch = pytest.importorskip("torch")
    resp = ModelResponse(
        input_tokens=[1, 2],
        output_tokens=[3, 4],
        output_logprobs=[-0.1, -0.2],
        output_versions=[5, 5],
        stop_reason="stop",
    )
    template = {"input_ids": torch.tensor([1, 2]), "output_ids": torch.tensor([3, 4]), "reward": torch.tensor(1.0)}
    [seq] = to_sequences(template, [resp])
    assert list(seq.input_ids) == [1, 2, 3, 4] and list(seq.loss_mask) == [0, 0, 1, 1] and seq.reward == 1.0
    assert list(seq.versions) == [-1, -1, 5, 5] and list(seq.logprobs) == pytest.approx([0, 0, -0.1, -0.2])
    with pytest.raises(WorkflowOutputError, match="match no engine response"):
        to_sequences({**template, "output_ids": [3]}, [resp])
    padded = {  # [1, L] with a padded tail: attention_mask keeps the valid tokens
        "input_ids": torch.tensor([[1, 2, 3, 0]]),
        "loss_mask": torch.tensor([[0, 0, 1, 0]]),
        "logprobs": torch.tensor([[0.0, 0.0, -0.5, 0.0]]),
        "versions": torch.tensor([[-1, -1, 2, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0]], dtype=torch.bool),
        "rewards": torch.tensor([0.5]),
    }
    [seq] = to_sequences(padded)
    assert list(seq.input_ids) == [1, 2, 3] and list(seq.versions) == [-1, -1, 2] and seq.reward == 0.5
    with pytest.raises(WorkflowOutputError, match="got shape \\(2, 4\\)"):
        to_sequences({**padded, "input_ids": torch.zeros((2, 4), dtype=torch.int32)})


async def test_reward_wrappers_built_per_run_share_the_workers_processes():
    """AReaL's agents build AsyncRewardWrapper(fn) inside every run(): in a worker they share one pool, which the
    worker (not the wrapper) closes."""
    async with WorkflowContext():
        first = AsyncRewardWrapper(reward_fns.sleepy, max_workers=None)
        assert first.max_workers == DEFAULT_MAX_WORKERS
        assert await first(0.0, value=0.5) == 0.5  # keyword arguments reach the function
        pids = first.pids
        await first.close()  # shared: nothing stops
        second = AsyncRewardWrapper(reward_fns.sleepy)
        assert await second(0.0) == 1.0 and second.pids == pids
    assert pids and not any(pid_alive(p) for p in pids)


async def test_rollout_workflow_from_the_add_a_workflow_guide(redis, redis_url, run_name):
    """The guide's MyWorkflow: ModelRequest(rid, input_ids, gconfig, tokenizer), AsyncRewardWrapper(reward_fn) with
    `**data`, and the short template {"input_ids", "output_ids", "reward"}: loss mask, logprobs and versions come
    from the engine's response."""
    trajs = await run(redis, redis_url, run_name, ["The answer is 5."], "tests.areal_agents:GuideWorkflow", n=2)
    assert [t.status for t in trajs] == ["ok", "ok"], [t.error for t in trajs]
    for t in trajs:
        [seq] = t.sequences
        n_out = sum(seq.loss_mask)
        assert seq.reward == 1.0 and n_out > 0 and "The answer is 5." in trained_text(seq)
        assert list(seq.loss_mask) == [0] * (len(seq.input_ids) - n_out) + [1] * n_out
        assert all(lp < 0 for lp in seq.logprobs[-n_out:]) and set(seq.logprobs[:-n_out]) == {0.0}
        assert set(seq.versions[:-n_out]) == {-1} and len(seq.versions) == len(seq.input_ids)


@pytest.mark.slow  # reward processes start (~5 s)
async def test_tensor_dict_and_workflow_context_in_a_worker(redis, redis_url, run_name):
    """rlvr.py's `[1, L]` tensors with rewards and attention_mask; workflow_context.get() gives the sample's index,
    its group's size and is_eval; the shared aiohttp / httpx clients are there."""
    jobs = [
        Job(job_id="train", workflow="tests.areal_agents:GuideTensorWorkflow", data=QUESTION, sample_index=i, n=2)
        for i in range(2)
    ] + [Job(job_id="eval", workflow="tests.areal_agents:GuideTensorWorkflow", data=QUESTION, is_eval=True)]
    trajs = await run(redis, redis_url, run_name, ["The answer is 5."], None, jobs=jobs)
    assert [t.status for t in trajs] == ["ok"] * 3, [t.error for t in trajs]
    assert [t.sequences[0].reward for t in trajs] == [1101.0, 201.0, 211.0]  # eval#0 (n=1), train#0, train#1
    seq = trajs[1].sequences[0]
    assert "The answer is 5." in trained_text(seq) and len(seq.input_ids) == len(seq.logprobs) == len(seq.versions)


async def test_template_output_ids_the_engine_never_returned_are_an_error_that_says_so(redis, redis_url, run_name):
    [t] = await run(redis, redis_url, run_name, ["The answer is 5."], "tests.areal_agents:GuideTamperingWorkflow")
    assert t.status == "error" and t.error.type == "WorkflowOutputError", t.error
    assert "match no engine response of this episode" in t.error.message


def test_builtin_workflows_read_areals_data_keys():
    """`messages` as a chat or as already-templated text (AReaL's vision datasets), `messages_chat` beside it."""
    from rollq.workers.builtin.episode import episode_prompt_ids

    tok = tiny_tokenizer()
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    base = episode_prompt_ids(tok, {"messages": chat})
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]}]
    assert episode_prompt_ids(tok, {"messages_chat": parts}) == base
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert episode_prompt_ids(tok, {"messages": text, "messages_chat": parts}) == base
