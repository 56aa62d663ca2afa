"""SyntheticBackend on its own: determinism across resubmission, length distributions, weights, speed."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys

import pytest

from rollq.engine.server.backend import GenState
from rollq.engine.server.synthetic import LengthDist, SyntheticBackend, SyntheticConfig
from rollq.engine.tiny_model import build_tiny, default_cache_dir
from rollq.engine.types import SamplingParams
from tests.helpers import REPO_ROOT, wait_until
from tests.scripted import scripted_engine, tiny_tokenizer


async def run(backend: SyntheticBackend, prompt: list[int], tokens: int, **params) -> GenState:
    state = GenState("r", prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True, **params), True)
    await backend.run(state)
    return state


@pytest.mark.parametrize("latency", [0.0, 0.001])
async def test_prompt_plus_partial_output_continues_identically(latency):
    backend = SyntheticBackend(SyntheticConfig(per_token_latency_s=latency, seed=7))
    full = await run(backend, [10, 11, 12], 30)
    rest = await run(backend, [10, 11, 12, *full.output_ids[:10]], 20)
    assert rest.output_ids == full.output_ids[10:]
    assert rest.output_logprobs == full.output_logprobs[10:]
    assert all(lp < 0 for lp in full.output_logprobs)
    other_seed = await run(SyntheticBackend(SyntheticConfig(seed=8)), [10, 11, 12], 30)
    assert other_seed.output_ids != full.output_ids
    await backend.close()


def test_length_distributions():
    rng = random.Random(0)
    pareto = [LengthDist.parse("pareto:16:1.2").sample(rng) for _ in range(4000)]
    assert min(pareto) >= 16 and max(pareto) > 20 * statistics.median(pareto)  # heavy tail
    uniform = [LengthDist.parse("uniform:5:9").sample(rng) for _ in range(500)]
    assert set(uniform) == {5, 6, 7, 8, 9}
    assert 80 < statistics.median(LengthDist.parse("lognormal:100:0.5").sample(rng) for _ in range(2000)) < 120
    assert LengthDist.parse("fixed").sample(rng) is None and LengthDist.parse("fixed:3").sample(rng) == 3
    with pytest.raises(ValueError):
        LengthDist.parse("zipf:1")


async def test_length_draw_ends_with_eos_capped_by_max_new_tokens():
    backend = SyntheticBackend(SyntheticConfig(length=LengthDist(kind="uniform", low=3, high=6)))
    for i in range(20):
        state = GenState(f"r{i}", [i + 3], SamplingParams(max_new_tokens=5))
        await backend.run(state)
        assert state.finish.type in ("stop", "length") and len(state.output_ids) <= 5
        if state.finish.type == "stop":
            assert state.output_ids[-1] == 2 and 2 not in state.output_ids[:-1]


async def test_load_weights_needs_an_existing_path(tmp_path):
    backend = SyntheticBackend()
    await backend.load_weights(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        await backend.load_weights(str(tmp_path / "nope"))


async def test_many_concurrent_short_generations_all_complete():
    # How fast: `python -m bench.engine` (a timed assertion here failed on a loaded machine).
    backend = SyntheticBackend()
    states = [
        GenState(f"r{i}", [3, i % 500 + 3], SamplingParams(max_new_tokens=16, ignore_eos=True)) for i in range(5000)
    ]
    await asyncio.gather(*(backend.run(s) for s in states))
    assert all(len(s.output_ids) == 16 for s in states)


def test_default_backend_keeps_the_byte_tokenizer():
    backend = SyntheticBackend()
    assert (backend.model_path, backend.vocab_size, backend.eos_token_ids) == ("synthetic", 32000, frozenset({2}))
    assert backend.encode("hé") == [b + 3 for b in "hé".encode()] and backend.decode(backend.encode("hé")) == "hé"


# --- scripted replies with the tiny ChatML tokenizer, over a real server on loopback ---

TOOL_REPLY = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
REPLIES = [TOOL_REPLY, "The sum is 5.", "Anything else?"]


def chat_ids(*turns: str) -> list[int]:
    """ChatML ids for alternating user/assistant turns (user first), ending in the generation prompt."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    text = tiny_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tiny_tokenizer().encode(text, add_special_tokens=False)


async def post(http, url: str, input_ids: list[int], max_new_tokens: int = 200, **params) -> dict:
    body = {
        "input_ids": input_ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, **params},
    }
    resp = await http.post(url + "/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


async def test_scripted_reply_follows_the_assistant_turn(http):
    eos = tiny_tokenizer().eos_token_id
    async with scripted_engine(REPLIES) as handle:
        info = (await http.get(handle.url + "/model_info")).json()
        assert info["model_path"] == str(build_tiny(default_cache_dir()))
        turns = ["What is 2 + 3?", TOOL_REPLY, '{"result": 5}', "The sum is 5.", "Thanks", "Anything else?", "No"]
        for n_assistant, want in [(0, REPLIES[0]), (1, REPLIES[1]), (2, REPLIES[2]), (3, REPLIES[2])]:
            out = await post(http, handle.url, chat_ids(*turns[: 2 * n_assistant + 1]))
            assert out["text"] == want, n_assistant
            assert out["output_ids"] == [*tiny_tokenizer().encode(want, add_special_tokens=False), eos]
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
            assert all(-4 < lp < 0 for lp in logprobs(out))
        # Text in goes through the same tokenizer.
        text = tiny_tokenizer().apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        body = {"text": text, "sampling_params": {"max_new_tokens": 100}}
        assert (await http.post(handle.url + "/generate", json=body)).json()["text"] == REPLIES[0]


def test_tool_call_text_round_trips_through_the_tiny_tokenizer():
    backend = SyntheticBackend(SyntheticConfig(tokenizer="tiny", replies=[TOOL_REPLY]))
    ids = backend.encode(TOOL_REPLY)
    assert ids[0] == tiny_tokenizer().convert_tokens_to_ids("<tool_call>")  # one added token
    assert backend.decode(ids) == TOOL_REPLY and backend.decode(ids, skip_special_tokens=True) == TOOL_REPLY
    assert backend.vocab_size == len(tiny_tokenizer())
    assert tiny_tokenizer().eos_token_id in backend.eos_token_ids


async def test_scripted_reply_respects_max_new_tokens_and_stops(http):
    reply_ids = tiny_tokenizer().encode(TOOL_REPLY, add_special_tokens=False)
    async with scripted_engine([TOOL_REPLY]) as handle:
        out = await post(http, handle.url, chat_ids("add 2 and 3"), max_new_tokens=3)
        assert out["output_ids"] == reply_ids[:3]
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        out = await post(http, handle.url, chat_ids("add 2 and 3"), stop=['"arguments'])
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": '"arguments'}
        assert out["text"] == TOOL_REPLY[: TOOL_REPLY.index('"arguments')]
        out = await post(http, handle.url, chat_ids("add 2 and 3"), stop_token_ids=[reply_ids[1]])
        assert out["output_ids"] == reply_ids[:2]


@pytest.mark.parametrize("latency", [0.0, 0.001])
@pytest.mark.parametrize("ignore_eos", [False, True])
async def test_scripted_resubmission_continues_the_same_reply(http, latency, ignore_eos):
    prompt = chat_ids("What is 2 + 3?", TOOL_REPLY, '{"result": 5}')
    async with scripted_engine(REPLIES, per_token_latency_s=latency) as handle:
        # With ignore_eos the reply runs on into hashed tokens: the resubmission must cross that boundary too.
        full = await post(http, handle.url, prompt, 12, ignore_eos=ignore_eos)
        assert full["text"].startswith(REPLIES[1][:5])
        ids = full["output_ids"]
        for m in (1, 3, len(ids) - 2, len(ids) - 1):
            rest = await post(http, handle.url, prompt + ids[:m], 12 - m, ignore_eos=ignore_eos)
            assert rest["output_ids"] == ids[m:], m
            assert logprobs(rest) == logprobs(full)[m:], m


async def test_scripted_reply_survives_a_retracting_pause(http):
    prompt = chat_ids("What is 2 + 3?")
    async with scripted_engine([TOOL_REPLY], per_token_latency_s=0.01) as handle:
        want = await post(http, handle.url, prompt)
        task = asyncio.create_task(
            http.post(
                handle.url + "/generate",
                json={"input_ids": prompt, "rid": "paused", "sampling_params": {"max_new_tokens": 200}},
            )
        )

        def started() -> bool:
            req = handle.server.states.get("paused")
            return req is not None and len(req.state.output_ids) >= 3

        await wait_until(started, 10, 0.002, what="3 tokens")
        assert (await http.post(handle.url + "/pause_generation", json={"mode": "retract"})).status_code == 200
        assert (await http.post(handle.url + "/continue_generation")).status_code == 200
        out = (await asyncio.wait_for(task, 10)).json()
        assert out["output_ids"] == want["output_ids"] and out["text"] == TOOL_REPLY
        assert out["meta_info"]["num_retractions"] == 1


def test_cli_replies_file_errors_exit_2(tmp_path):
    bad = tmp_path / "replies.json"
    bad.write_text('{"not": "a list"}')
    for path in (bad, tmp_path / "missing.json"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollq.engine",
                "--backend",
                "synthetic",
                "--port",
                "0",
                "--replies-file",
                str(path),
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "--replies-file" in proc.stderr


@pytest.mark.slow
async def test_cli_serves_scripted_replies(engine_process, http, tmp_path):
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps(REPLIES))
    _, url = await engine_process("--tokenizer", "tiny", "--replies-file", str(replies), "--no-skip-tokenizer-init")
    out = await post(http, url, chat_ids("What is 2 + 3?", TOOL_REPLY, '{"result": 5}'))
    assert out["text"] == REPLIES[1]


def test_the_tiny_tokenizer_without_torch_is_autotokenizers():
    # The synthetic engine loads "tiny" as a plain fast tokenizer (no torch import); workers, proxy and trainer use
    # AutoTokenizer. Every id, text and prompt must agree, or token-exact checks would drift apart.
    from transformers import AutoTokenizer

    from rollq.engine.server.synthetic import load_tokenizer

    fast, path = load_tokenizer("tiny")
    auto = AutoTokenizer.from_pretrained(path, local_files_only=True)
    rng = random.Random(0)
    alphabet = "abcxyz 0123456789+-*=?.,\n\té中🙂" + "".join(auto.all_special_tokens)
    texts = ["", "What is 12 + 7? <|im_end|>\n<|im_start|>assistant\n19"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(300)]
    for text in texts:
        assert fast.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False), text
    for _ in range(100):
        ids = [rng.randrange(len(auto)) for _ in range(24)]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip), ids
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "x"},
    ]
    assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert (len(fast), fast.eos_token_id, fast.pad_token_id) == (len(auto), auto.eos_token_id, auto.pad_token_id)
