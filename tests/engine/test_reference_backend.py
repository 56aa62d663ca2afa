"""ReferenceBackend driven directly (no HTTP), on the tiny model built offline into a temporary directory."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from rollq.engine.server.backend import GenState  # noqa: E402
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig  # noqa: E402
from rollq.engine.server.sampler import RowSpec, request_key, sample, uniforms  # noqa: E402
from rollq.engine.tiny_model import SPEC_FILE, TOOL_TOKENS, build_tiny  # noqa: E402
from rollq.engine.types import SamplingParams  # noqa: E402

TEXTS = [
    "What is 2 + 2?",
    "Solve for x: 3x + 5 = 20. Subtract 5 from both sides, then divide by three.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))",
    "Hi",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Paris",  # the tiny model's greedy answer ends with EOS after 17 tokens
]


@pytest.fixture(scope="module")
def ref_model(tiny_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True).eval()


@pytest.fixture(scope="module")
def prompts(tiny_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture
async def backend(tiny_dir: Path):
    b = ReferenceBackend(ReferenceConfig(model=str(tiny_dir), max_running=3))
    await b.start()
    yield b
    await b.close()


def generate(model, prompt: list[int], max_new: int, stop_at_eos: bool = True) -> list[int]:
    """The sequential baseline: HF generate, greedy, EOS on or off."""
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos  # generate falls back to the model's EOS when given None
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), generation_config=gen)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt) :].tolist()


def greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- the tiny model ------------------------------------------------------------------------------------------------


def test_tiny_model_builds_offline_loads_and_is_cached(tiny_dir: Path, tmp_path: Path, ref_model) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert ref_model.config.vocab_size == len(tok)
    assert ref_model.config.num_hidden_layers == 2 and ref_model.config.max_position_embeddings == 2048
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *TOOL_TOKENS):
        assert len(tok.encode(t)) == 1, t
    assert tok.eos_token == "<|im_end|>"
    # tool tags are kept in decoded text (tool parsers need them); chat markers are skipped
    ids = tok.encode("<|im_start|>x<tool_call>{}</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "x<tool_call>{}</tool_call>"

    stamp = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_tiny(tiny_dir) == tiny_dir
    assert time.perf_counter() - t0 < 0.5 and (tiny_dir / "model.safetensors").stat().st_mtime_ns == stamp
    other = build_tiny(tmp_path / "again")  # deterministic: same bytes from a fresh build
    for name in ("model.safetensors", "tokenizer.json", "config.json", SPEC_FILE):
        assert sha(other / name) == sha(tiny_dir / name), name


def test_chat_template_renders_roles_and_tool_calls(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "content": '{"t": 21}'},
        {"role": "tool", "content": '{"t": 25}'},
        {"role": "assistant", "content": "21 and 25."},
        {"role": "user", "content": "Thanks"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    expected_parts = [
        "<|im_start|>system\nBe brief.\n\n# Tools\n",
        '<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}'
        "\n</tools>",
        "<|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n",
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n',
        '<|im_start|>user\n<tool_response>\n{"t": 21}\n</tool_response>\n<tool_response>\n{"t": 25}\n'
        "</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n21 and 25.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n",
    ]
    pos = 0
    for part in expected_parts:
        found = text.find(part, pos)
        assert found >= 0, (part, text)
        pos = found + len(part)
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"  # no tools, no system: nothing else
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<tool_call>")) == 4  # two calls + two in the tools instructions


# ---- sampling ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "probs"),
    [
        (SamplingParams(temperature=1.0), torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0]), 0).tolist() + [0.0]),
        (SamplingParams(temperature=0.5, top_k=2), torch.softmax(torch.tensor([4.0, 2.0]), 0).tolist() + [0.0] * 3),
        (SamplingParams(temperature=1.0, top_p=0.8), torch.softmax(torch.tensor([2.0, 1.0]), 0).tolist() + [0.0] * 3),
        (SamplingParams(temperature=1.0, min_p=0.3), torch.softmax(torch.tensor([2.0, 1.0]), 0).tolist() + [0.0] * 3),
    ],
)
def test_sampler_follows_the_filtered_distribution(params: SamplingParams, probs: list[float]) -> None:
    n = 4000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).expand(n, 5)
    rows = [RowSpec(params, [], request_key(0, f"dist-{i}"), []) for i in range(n)]
    tokens, logprobs = sample(logits, rows)
    raw = torch.log_softmax(logits[0], 0)
    assert torch.allclose(torch.tensor(logprobs), raw[tokens])  # logprobs of the raw logits, not the filtered ones
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float()
    assert torch.allclose(counts / n, torch.tensor(probs), atol=0.03)


def test_sampler_penalties_and_min_new_tokens() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    gen = request_key(0, "p")
    assert sample(logits, [RowSpec(SamplingParams(temperature=0.0), [0, 0], gen, [])])[0] == [0]
    assert sample(logits, [RowSpec(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], gen, [])])[0] == [1]
    assert sample(logits, [RowSpec(SamplingParams(temperature=0.0, frequency_penalty=0.6), [0, 0], gen, [])])[0] == [1]
    assert sample(logits, [RowSpec(SamplingParams(temperature=0.0, presence_penalty=1.5), [0], gen, [])])[0] == [1]
    # stop ids are masked until min_new_tokens were produced
    assert sample(logits, [RowSpec(SamplingParams(temperature=0.0, min_new_tokens=2), [5], gen, [0])])[0] == [1]
    assert sample(logits, [RowSpec(SamplingParams(temperature=0.0, min_new_tokens=1), [5], gen, [0])])[0] == [0]


def test_sampler_draws_do_not_depend_on_the_batch() -> None:
    """A row's uniform comes from (its request key, its position) alone: the same token alone, in any batch
    composition (greedy, filtered, penalised neighbours) and any order; another position or key draws anew."""
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(6, vocab)
    specs = [
        RowSpec(SamplingParams(temperature=1.0), [], request_key(0, "a"), []),
        RowSpec(SamplingParams(temperature=0.7, top_p=0.9), [3, 4], request_key(0, "b"), []),
        RowSpec(SamplingParams(temperature=0.0), [], request_key(0, "c"), []),
        RowSpec(SamplingParams(temperature=1.2, top_k=5, min_p=0.05), [1], request_key(0, "d"), []),
        RowSpec(SamplingParams(temperature=1.0, frequency_penalty=0.5), [7, 7, 2], request_key(0, "e"), []),
        RowSpec(SamplingParams(temperature=1.0), [1] * 9, request_key(0, "f"), []),
    ]
    alone = [sample(logits[i : i + 1], [specs[i]]) for i in range(6)]
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 4, 2, 0], [1, 5], [4, 0, 3]):
        tokens, logprobs = sample(logits[order], [specs[i] for i in order])
        assert tokens == [alone[i][0][0] for i in order]
        assert logprobs == pytest.approx([alone[i][1][0] for i in order], abs=1e-6)
    # the unfiltered fast path (every row plain softmax at temperature 1) picks what the general path picks
    plain = [0, 5]
    assert sample(logits[plain], [specs[i] for i in plain])[0] == [alone[i][0][0] for i in plain]
    u = uniforms(torch.tensor([request_key(0, "a")] * 3 + [request_key(1, "a")]), torch.tensor([0, 1, 2, 0]))
    assert len(set(u.tolist())) == 4 and bool(((u >= 0) & (u < 1)).all())
    many = uniforms(torch.tensor([request_key(0, f"k{i}") for i in range(20000)]), torch.zeros(20000, dtype=torch.long))
    assert abs(float(many.mean()) - 0.5) < 0.01 and float(many.min()) >= 0 and float(many.max()) < 1


# ---- continuous batching -------------------------------------------------------------------------------------------


async def test_continuous_batching_matches_sequential_generate(
    backend: ReferenceBackend, ref_model, prompts: list[list[int]]
) -> None:
    max_new = [8, 30, 16, 24, 12, 30]
    states = [GenState(f"cb-{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
    tasks = [asyncio.create_task(backend.run(states[0])), asyncio.create_task(backend.run(states[1]))]
    await until(lambda: len(states[0].output_ids) >= 3)  # later requests join a running batch
    tasks.append(asyncio.create_task(backend.run(states[2])))
    await until(lambda: len(states[2].output_ids) >= 2)
    tasks += [asyncio.create_task(backend.run(s)) for s in states[3:]]  # max_running=3: these wait for a free row
    await asyncio.sleep(0)
    assert backend.stats()["num_queue_reqs"] >= 1
    await asyncio.gather(*tasks)
    for s, n in zip(states, max_new, strict=True):
        assert s.output_ids == generate(ref_model, s.input_ids, n), s.rid
        assert s.finish is not None and s.finish.type in ("stop", "length")
        if s.finish.type == "stop":
            assert s.finish.matched == s.output_ids[-1] and s.finish.matched in backend.eos_token_ids
        else:
            assert s.finish.length == n == len(s.output_ids)
    assert {s.finish.type for s in states} == {"stop", "length"}  # rows left on EOS and on length
    stats = backend.stats()
    assert stats["num_running_reqs"] == 0 and stats["num_queue_reqs"] == 0
    # every token counted once (an exact total: gen_throughput's window is time, which a loaded machine stretches)
    assert stats["generated_tokens_total"] == sum(len(s.output_ids) for s in states)


async def test_logprobs_match_a_direct_forward_pass(
    backend: ReferenceBackend, ref_model, prompts: list[list[int]]
) -> None:
    params = [
        SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=50, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=1.0, min_p=0.05, ignore_eos=True),
        greedy(10, ignore_eos=True),
    ]
    states = [GenState(f"lp-{i}", prompts[i], p, return_logprob=True) for i, p in enumerate(params)]
    await asyncio.gather(*(backend.run(s) for s in states))
    for s in states:
        assert len(s.output_logprobs) == len(s.output_ids) == s.params.max_new_tokens
        ids = torch.tensor([s.input_ids + s.output_ids])
        with torch.inference_mode():
            logits = ref_model(ids).logits[0, len(s.input_ids) - 1 : -1]
        want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(s.output_logprobs), want, atol=1e-4), s.rid
    # sampling is seeded by (engine seed, rid): the same rid samples the same tokens again, another rid does not
    again = GenState("lp-0", prompts[0], params[0])
    other = GenState("lp-other", prompts[0], params[0])
    await asyncio.gather(backend.run(again), backend.run(other))
    assert again.output_ids == states[0].output_ids
    assert other.output_ids != states[0].output_ids


async def test_max_new_tokens_stop_token_ids_and_stop_strings(
    backend: ReferenceBackend, prompts: list[list[int]]
) -> None:
    full = GenState("full", prompts[1], greedy(24, ignore_eos=True))
    short = GenState("short", prompts[1], greedy(5, ignore_eos=True))
    await asyncio.gather(backend.run(full), backend.run(short))
    g = full.output_ids
    assert short.output_ids == g[:5] and short.finish.type == "length" and short.finish.length == 5

    j = g.index(g[6])
    by_id = GenState("by-id", prompts[1], greedy(24, ignore_eos=True, stop_token_ids=[g[6]]))
    await backend.run(by_id)
    assert by_id.output_ids == g[: j + 1]
    assert by_id.finish.type == "stop" and by_id.finish.matched == g[6]

    def raw(ids: list[int]) -> str:  # stop strings match the raw tail, special tokens included (as SGLang)
        return backend.decode(ids, skip_special_tokens=False)

    k = next(k for k in range(8, 24) if "\ufffd" not in raw(g[:k])[-2:] and raw(g[:k])[-2:].strip())
    stop = raw(g[:k])[-2:]
    expected = next(n for n in range(1, 25) if raw(g[:n][-32:]).endswith(stop))
    by_str = GenState("by-str", prompts[1], greedy(24, ignore_eos=True, stop=[stop]))
    await backend.run(by_str)
    assert by_str.output_ids == g[:expected] and by_str.finish.type == "stop" and by_str.finish.matched == stop


async def test_context_length_is_enforced(tiny_dir: Path, prompts: list[list[int]]) -> None:
    b = ReferenceBackend(ReferenceConfig(model=str(tiny_dir), context_length=len(prompts[4]) + 4))
    await b.start()
    try:
        s = GenState("ctx", prompts[4], greedy(100, ignore_eos=True))
        await b.run(s)
        assert s.finish.type == "length" and len(s.output_ids) == 4
        with pytest.raises(ValueError, match="longer than the model's context length"):
            await b.run(GenState("too-long", prompts[4] * 2, greedy(4)))
    finally:
        await b.close()


async def test_tiny_backend_keeps_the_event_loop_responsive(
    tiny_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLQ_CACHE", str(tiny_dir.parent))  # model="tiny" finds the build there
    b = ReferenceBackend(ReferenceConfig(model="tiny", max_running=32))
    await b.start()
    try:
        assert b.model_path == str(tiny_dir) and b.eos_token_ids == {0, 2} and b.context_length == 2048
        states = [GenState(f"busy-{i}", prompts[i % len(prompts)], greedy(48, ignore_eos=True)) for i in range(32)]
        batch = asyncio.gather(*(b.run(s) for s in states))
        lag = 0.0
        while not batch.done():  # the torch work runs off the loop: timers keep firing on time
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lag = max(lag, time.perf_counter() - t0 - 0.005)
        await batch
        assert all(len(s.output_ids) == 48 for s in states)
        assert lag < 0.25, lag
    finally:
        await b.close()


# ---- abort and pause -----------------------------------------------------------------------------------------------


async def test_abort_mid_generation_keeps_partial_tokens(
    backend: ReferenceBackend, ref_model, prompts: list[list[int]]
) -> None:
    s = GenState("ab", prompts[2], greedy(1000, ignore_eos=True), return_logprob=True)
    task = asyncio.create_task(backend.run(s))
    await until(lambda: len(s.output_ids) >= 5)
    s.abort_message = "stop now"
    await asyncio.wait_for(task, 10)
    assert s.finish.type == "abort" and s.finish.message == "stop now"
    assert 5 <= len(s.output_ids) < 1000 and len(s.output_logprobs) == len(s.output_ids)
    assert s.output_ids == generate(ref_model, s.input_ids, len(s.output_ids), stop_at_eos=False)

    # aborted while waiting (paused): no tokens; a cancelled caller's state is dropped
    await backend.pause("in_place")
    waiting = GenState("ab-wait", prompts[0], greedy(8))
    task = asyncio.create_task(backend.run(waiting))
    await asyncio.sleep(0.01)
    waiting.abort_message = "Abort in waiting queue"
    await asyncio.wait_for(task, 5)
    assert waiting.finish.type == "abort" and waiting.output_ids == []
    await backend.resume()
    gone = GenState("ab-cancel", prompts[0], greedy(1000, ignore_eos=True))
    task = asyncio.create_task(backend.run(gone))
    await until(lambda: len(gone.output_ids) >= 2)
    task.cancel()
    await until(lambda: gone.finish is not None and backend.stats()["num_running_reqs"] == 0, 5)
    assert gone.finish.type == "abort"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_then_resume_gives_the_uninterrupted_tokens(
    backend: ReferenceBackend, ref_model, prompts: list[list[int]], mode: str
) -> None:
    states = [GenState(f"p-{mode}-{i}", prompts[i], greedy(20, ignore_eos=True), return_logprob=True) for i in range(3)]
    tasks = [asyncio.create_task(backend.run(s)) for s in states]
    await until(lambda: all(len(s.output_ids) >= 3 for s in states))
    await backend.pause(mode)
    frozen = [len(s.output_ids) for s in states]
    assert all(n < 20 for n in frozen)
    await asyncio.sleep(0.1)
    assert [len(s.output_ids) for s in states] == frozen  # nothing decodes while paused
    stats = backend.stats()
    if mode == "retract":
        assert stats["num_queue_reqs"] == 3 and stats["token_usage"] == 0
    else:
        assert stats["num_running_reqs"] == 3 and stats["token_usage"] > 0
    await backend.resume()
    await asyncio.wait_for(asyncio.gather(*tasks), 20)
    for s in states:
        assert s.output_ids == generate(ref_model, s.input_ids, 20, stop_at_eos=False), s.rid
        assert len(s.output_logprobs) == 20 and s.finish.type == "length"


# ---- weights -------------------------------------------------------------------------------------------------------


async def test_load_weights_changes_outputs_and_rejects_bad_input(
    backend: ReferenceBackend, ref_model, prompts: list[list[int]], tiny_dir: Path, tmp_path: Path
) -> None:
    async def once(rid: str) -> list[int]:
        s = GenState(rid, prompts[1], greedy(12, ignore_eos=True))
        await backend.run(s)
        return s.output_ids

    before = await once("w-0")
    state = {k: v.clone() for k, v in ref_model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"].flip(0)  # a different policy, same names and shapes
    (tmp_path / "step-1").mkdir()
    save_file(state, str(tmp_path / "step-1" / "model.safetensors"))

    await backend.pause("in_place")
    await backend.load_weights(str(tmp_path / "step-1"))
    await backend.resume()
    after = await once("w-1")
    assert after != before

    with pytest.raises(FileNotFoundError, match="does not exist"):
        await backend.load_weights(str(tmp_path / "nowhere"))
    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    save_file(bad, str(tmp_path / "bad-shape.safetensors"))
    with pytest.raises(ValueError, match="shape mismatch.*model.norm.weight"):
        await backend.load_weights(str(tmp_path / "bad-shape.safetensors"))
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="missing \\['model.norm.weight'\\]"):
        await backend.load_weights(str(tmp_path / "missing.safetensors"))
    assert await once("w-2") == after  # a rejected load changes nothing

    await backend.load_weights(str(tiny_dir))  # back to the original weights (the file itself, this time)
    assert await once("w-3") == before
